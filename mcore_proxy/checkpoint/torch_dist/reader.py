"""Megatron `torch_dist` checkpoints, read as a canonical ModelView (files: `torch_dist/files.py`).

Reading never runs foreign code: `.metadata` goes through a restricted unpickler that keeps every
class as inert data, `common.pt` and the chunks through torchfile's restricted reader. Neither
`torch.load` nor `FileSystemReader.read_metadata()` (a plain `pickle.load`) is used, and no
process group is needed.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.iteration import resolve_iteration_dir, tracked_folder
from mcore_proxy.checkpoint.layer_spec import infer_layer_spec
from mcore_proxy.checkpoint.layout import ParallelLayout, layout_from_args
from mcore_proxy.checkpoint.names import (
    GROUPED,
    SEQUENTIAL,
    TE_GROUPED,
    DistName,
    canonical_sort_key,
    is_ignored_dist_key,
    parse_dist_key,
    parse_object_key,
    uses_local_spec,
)
from mcore_proxy.checkpoint.safe_globals import unresolved_class
from mcore_proxy.checkpoint.torch_dist.files import BACKEND, COMMON_FILE, CONFIG_FILE, DCP_METADATA
from mcore_proxy.checkpoint.torchfile import (
    UNREADABLE,
    LazyTensor,
    TorchFile,
    brief_error,
    materialize,
    unpickle_torch_zip,
)
from mcore_proxy.checkpoint.view import ModelView, ViewInfo
from mcore_proxy.core.dtypes import itemsize, torch_dtype
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.megatron_args import arg, arg_int
from mcore_proxy.mcore.sharding import rule_for
from mcore_proxy.mcore.spec import ModelSpec, layer_module_prefix

if TYPE_CHECKING:
    import torch


# -- locating the iteration folder ------------------------------------------------------------


def _has_markers(folder: Path) -> bool:
    return folder.is_dir() and (
        (folder / CONFIG_FILE).is_file()
        or (folder / DCP_METADATA).is_file()
        or (folder / COMMON_FILE).is_file()
        or any(folder.glob("*.distcp"))
    )


def _is_dist_folder(folder: Path) -> bool:
    """An iteration folder written by dist_checkpointing (maybe incompletely)."""
    config = folder / CONFIG_FILE
    if config.is_file():
        try:
            return json.loads(config.read_bytes()).get("sharded_backend") is not None
        except (ValueError, OSError, AttributeError, RecursionError):
            return True  # damaged metadata.json: let the reader say so
    return _has_markers(folder)


def is_torch_dist_checkpoint(path) -> bool:
    """A checkpoint root whose tracker names a dist-checkpoint iteration folder, or that folder."""
    path = Path(path)
    if not path.is_dir():
        return False
    target = tracked_folder(path)
    if target is not None:
        return _is_dist_folder(target)
    return _is_dist_folder(path)


def resolve_dist_dir(path) -> tuple[Path, int | str]:
    """Checkpoint root (with tracker) or an iteration folder -> (iteration folder, iteration):
    the legacy rules and messages, with torch_dist's files marking an iteration folder."""
    return resolve_iteration_dir(
        path,
        _has_markers,
        f"not a torch_dist checkpoint (no {CONFIG_FILE}, {DCP_METADATA} or *.distcp "
        "files); pass the folder Megatron saved with --ckpt-format torch_dist",
    )


# -- reading .metadata without running foreign code -------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) == ("torch", "Size"):
            return torch.Size
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return unresolved_class(module, name)


def read_dcp_metadata(path: Path):
    """The `.metadata` file as records: `.state_dict_metadata`, `.storage_data` (dicts)."""
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; the torch_dist save did not finish or the file was "
            "lost, copy the iteration folder again from the source"
        )
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
        sd_md, storage = md.state_dict_metadata, md.storage_data
    except UNREADABLE as err:
        raise CheckpointError(
            f"{path}: not a readable PyTorch DCP metadata file ({brief_error(err)}); it is "
            "truncated or damaged, copy it again from the source"
        ) from None
    if not isinstance(sd_md, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path}: holds no key table; it is damaged, copy it again from the source")
    return sd_md, storage


def _byte_count(value, path: Path, key) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(
            f"{path}: storage entry of {str(key)[:60]} has byte offset or length "
            f"{str(value)[:40]}; the file is damaged, copy it again"
        )
    return value


def _props_dtype(props) -> torch.dtype:
    """TensorProperties pickles as a tuple (dtype, layout, ...) since torch 2.0, a dict before."""
    import torch

    state = props._state
    dtype = state[0] if isinstance(state, tuple) else (state or {}).get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"tensor properties without a dtype: {props!r}")
    return dtype


# -- reading chunks ---------------------------------------------------------------------------


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file."""

    def __init__(self, fh, start: int, length: int):
        super().__init__()
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf):
        view = memoryview(buf).cast("B")
        want = max(0, min(len(view), self._length - self._pos))
        self._fh.seek(self._start + self._pos)
        done = 0
        while done < want:  # a read may return short counts
            n = self._fh.readinto(view[done:want])
            if not n:
                break
            done += n
        self._pos += done
        return done


@dataclass(frozen=True)
class _Chunk:
    """One stored chunk: its box in the key's global tensor and its bytes."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    start: int
    length: int


class _Blob:
    """One chunk's torch.save blob inside a .distcp file.

    Its `data.pkl` goes through torchfile's restricted unpickler, so tensors are LazyTensors that
    call `read_elements` here: only the bytes asked for are read, straight from the file (torch
    stores zip members uncompressed, so a storage is one run of bytes).
    """

    def __init__(self, chunk: _Chunk):
        self.path, self._chunk = chunk.file, chunk
        self._fh = open(chunk.file, "rb")
        try:
            self._zip = zipfile.ZipFile(_Window(self._fh, chunk.start, chunk.length))
            self.obj = unpickle_torch_zip(self._zip, self)
        except UNREADABLE as err:
            self._fh.close()
            raise self._damaged(brief_error(err)) from None

    def _damaged(self, why: str) -> CheckpointError:
        c = self._chunk
        return CheckpointError(
            f"{c.file}: the chunk of {c.key} at byte {c.start} is not a readable torch.save "
            f"blob ({why}); the file is damaged, copy it again from the source"
        )

    def read_elements(self, storage, start: int, count: int) -> torch.Tensor:
        """`count` elements from element `start` of a storage (the LazyTensor protocol)."""
        import torch

        item = itemsize(storage.dtype)
        try:
            info = self._zip.getinfo(storage.member)
        except KeyError:
            raise self._damaged(f"no member {storage.member}") from None
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.file_size < storage.numel * item
            or start + count > storage.numel
        ):
            raise self._damaged(f"member {storage.member} does not hold its {storage.numel} elements")
        window = _Window(self._fh, self._chunk.start, self._chunk.length)
        window.seek(info.header_offset)
        header = window.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise self._damaged(f"bad local header of {storage.member}")
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        window.seek(info.header_offset + 30 + name_len + extra_len + start * item)
        out = torch.empty(count, dtype=torch_dtype(storage.dtype))
        if count and window.readinto(memoryview(out.view(torch.uint8).numpy())) != count * item:
            raise self._damaged(f"{storage.member} ends early")
        return out

    def close(self):
        self._zip.close()
        self._fh.close()


def _read_block(chunk: _Chunk, local: tuple[int, ...], inner: tuple[int, ...], dtype) -> torch.Tensor:
    """The [inner] block at prepended position `local` of a chunk, reading only its bytes."""
    blob = _Blob(chunk)
    try:
        lazy = blob.obj
        if not isinstance(lazy, LazyTensor) or tuple(lazy.shape) != chunk.sizes or lazy.dtype != dtype:
            got = (tuple(lazy.shape), lazy.dtype) if isinstance(lazy, LazyTensor) else type(lazy).__name__
            raise CheckpointError(
                f"{chunk.file}: chunk of {chunk.key} at byte {chunk.start} holds {got}, "
                f"metadata says {chunk.sizes} {dtype}; the file does not belong to "
                "this .metadata, copy the folder again"
            )
        start = 0  # row-major position of `local` on the prepended axes, in blocks
        for i, n in zip(local, chunk.sizes[: len(local)]):
            start = start * n + i
        per = math.prod(inner)
        return lazy.read_flat(start * per, per).view(inner)
    finally:
        blob.close()


def _read_object(chunk: _Chunk):
    """A ShardedObject's value: its blob is torch.save([value])."""
    blob = _Blob(chunk)
    try:
        value = materialize(blob.obj)
    finally:
        blob.close()
    if not isinstance(value, list) or not value:
        raise CheckpointError(
            f"{chunk.file}: object {chunk.key} is not a saved [value] list; the file is damaged, copy it again"
        )
    return value[0]


# -- the reader -------------------------------------------------------------------------------


@dataclass
class _TensorEntry:
    key: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass
class _ObjectEntry:
    chunk: _Chunk
    value: object = None
    loaded: bool = False


def _read_common(it_dir: Path):
    path = it_dir / COMMON_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; Megatron writes args and iteration there, copy it from the source checkpoint"
        )
    common = TorchFile(path).obj
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}: holds {type(common).__name__}, not Megatron's common state dict")
    return common


def _check_config(it_dir: Path) -> None:
    path = it_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing, so the torch_dist save did not complete (Megatron writes "
            "it last); use a checkpoint whose save finished"
        )
    try:
        backend = json.loads(path.read_bytes()).get("sharded_backend")
    except (ValueError, OSError, AttributeError, RecursionError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); copy it again from the source") from None
    if backend != BACKEND:
        raise CheckpointError(
            f"{path}: sharded backend {backend!r} is not supported, only {BACKEND!r}; "
            "re-save the checkpoint with --ckpt-format torch_dist"
        )


def _layout_of(args, where: Path) -> ParallelLayout:
    """The saving run's layout (informational: torch_dist files do not depend on it)."""
    if arg(args, "moe_grouped_gemm"):
        te = arg(args, "transformer_impl") == "transformer_engine"
        expert_layout = TE_GROUPED if te and not arg(args, "moe_use_legacy_grouped_gemm") else GROUPED
    else:
        expert_layout = SEQUENTIAL
    try:
        base = layout_from_args(args, where)
    except ProxyError:  # e.g. pipeline_model_parallel_layout: keep sizes, no stage split
        size = lambda n: arg_int(args, n, str(where), minimum=1, maximum=1 << 20)  # noqa: E731
        tp = size("tensor_model_parallel_size") or 1
        base = ParallelLayout(
            tp=tp,
            pp=size("pipeline_model_parallel_size") or 1,
            ep=size("expert_model_parallel_size") or 1,
            etp=size("expert_tensor_parallel_size") or tp,
        )
    return dataclasses.replace(base, expert_layout=expert_layout)


class TorchDistCheckpoint(ModelView):
    """A Megatron torch_dist checkpoint as a canonical ModelView.

    Opening reads metadata.json, common.pt and `.metadata` only; `get(name)` reads the chunks
    that make up that tensor (for an expert of a GroupedMLP chunk, only that expert's bytes).
    """

    def __init__(self, path):
        self.path, iteration = resolve_dist_dir(path)
        _check_config(self.path)
        common = _read_common(self.path)
        args = common.get("args")
        if args is None:
            raise CheckpointError(
                f"{self.path / COMMON_FILE}: no 'args' entry; mcore-proxy needs the args "
                "Megatron saves (was the checkpoint written with --no-save-args?)"
            )
        if isinstance(iteration, str) and iteration != "release" and isinstance(common.get("iteration"), int):
            iteration = common["iteration"]  # a folder not named iter_*: trust common.pt
        content = common.get("content_metadata") or {}
        if not isinstance(content, dict):
            raise CheckpointError(
                f"{self.path / COMMON_FILE}: content_metadata is a {type(content).__name__}, "
                "not Megatron's dict of flags; the file is damaged, copy it again"
            )
        if content.get("singleton_local_shards"):
            raise CheckpointError(
                f"{self.path}: saved with singleton_local_shards (one key per expert and "
                "GLU half), which is not supported yet; re-save without it"
            )
        self._spec = ModelSpec.from_args(args, where=str(self.path / COMMON_FILE))
        if self._spec.noop_layers:
            raise CheckpointError(
                f"{self.path}: args say noop_layers {list(self._spec.noop_layers)} (MindSpeed "
                "--noop-layers), which mcore-proxy reads from legacy checkpoints only; the nearest "
                "supported kind is the same model saved with --ckpt-format torch"
            )
        self.local_spec = uses_local_spec(args)
        sd_md, storage = read_dcp_metadata(self.path / DCP_METADATA)
        self._layer_spec = infer_layer_spec(args, dict.fromkeys(sd_md), 1, str(self.path / COMMON_FILE))
        self._storage = self._index_storage(storage)
        self._tensors: dict[str, _TensorEntry] = {}
        self._objects: dict[str, _ObjectEntry] = {}
        self._index_metadata(sd_md)
        self._check_files()
        self._check_complete()
        dropped = self._resolve_none_objects()
        for name in list(self._tensors) + list(self._objects):
            rule_for(name, self._layer_spec)  # a name no sharding rule knows is an error, never silently kept
        self._names = sorted(list(self._tensors) + list(self._objects), key=canonical_sort_key)
        super().__init__(
            ViewInfo(
                spec=self._spec,
                format="torch_dist",
                path=self.path,
                iteration=iteration,
                args=args,
                checkpoint_version=common.get("checkpoint_version"),
                layout=_layout_of(args, self.path),
                # writers re-create None extra states for every linear of the target modules
                linear_extra_state=dropped > 0,
                layer_spec=self._layer_spec,
            )
        )

    # -- indexing ----------------------------------------------------------------------------
    def _index_storage(self, storage: dict) -> dict:
        """(key, chunk offsets) -> (data file, byte offset, byte length), every entry checked: a
        file name from `.metadata` must be a plain name inside this folder (never `../x` or an
        absolute path), offsets and lengths non-negative integers."""
        md_path = self.path / DCP_METADATA
        out = {}
        for idx, info in storage.items():
            try:
                offset = getattr(idx, "offset", None)  # pickles leave out None fields
                offset = None if offset is None else tuple(offset)
                fqn, name = idx.fqn, info.relative_path
                start, length = info.offset, info.length
                transforms = getattr(info, "transform_descriptors", None)
            except (AttributeError, TypeError) as err:
                raise CheckpointError(
                    f"{md_path}: storage table entry without {err}; the file is damaged, copy it again"
                ) from None
            if not isinstance(fqn, str) or not all(isinstance(o, int) for o in offset or ()):
                raise CheckpointError(f"{md_path}: storage table entry {str(fqn)[:60]} is damaged; copy the file again")
            out[(fqn, offset)] = (
                self._data_file(name),
                _byte_count(start, md_path, fqn),
                _byte_count(length, md_path, fqn),
            )
            if transforms:
                raise CheckpointError(
                    f"{md_path}: chunks are stored with transforms "
                    f"{transforms} (compression), which is not supported; re-save without"
                )
        return out

    def _data_file(self, name) -> Path:
        """A data file named by `.metadata`, confined to this iteration folder."""
        bad = (
            not isinstance(name, str)
            or not name
            or name in (".", "..")
            or "/" in name
            or "\\" in name
            or "\0" in name
            or Path(name).is_absolute()
        )
        if bad:
            raise CheckpointError(
                f"{self.path / DCP_METADATA}: names the data file {str(name)[:80]!r}, which "
                "is not a file of this folder; the metadata is damaged or hostile, copy the "
                "checkpoint again from its source"
            )
        return self.path / name

    def _index_metadata(self, sd_md: dict) -> None:
        """Index every key of `.metadata`; records of the wrong shape are one sentence, not a crash."""
        try:
            for key, md in sd_md.items():
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"{self.path / DCP_METADATA}: key {str(key)[:60]} is not a string; "
                        "the file is damaged, copy it again"
                    )
                if is_ignored_dist_key(key):
                    continue
                if getattr(md, "_name", "") == "BytesStorageMetadata":
                    self._index_object(key)
                elif getattr(md, "_name", "") == "TensorStorageMetadata":
                    self._index_tensor(key, md)
                else:
                    raise CheckpointError(f"{self.path / DCP_METADATA}: key {key} has unknown metadata {md!r}")
        except ProxyError:
            raise
        except (TypeError, AttributeError, ValueError, IndexError, OverflowError, RuntimeError) as err:
            raise CheckpointError(
                f"{self.path / DCP_METADATA}: a key record is damaged ({brief_error(err)}); "
                "copy the file again from the source"
            ) from None

    def _chunk(self, key: str, offsets) -> _Chunk:
        where = self._storage.get((key, offsets))
        if where is None:
            raise CheckpointError(
                f"{self.path / DCP_METADATA}: no storage entry for {key} at {offsets}; "
                "the file is damaged, copy it again"
            )
        return _Chunk(key, offsets or (), (), *where)

    def _index_tensor(self, key: str, md) -> None:
        import torch

        dist = parse_dist_key(key, self.local_spec)
        n = len(dist.axes)
        size = tuple(md.size)
        if not all(isinstance(x, int) and x >= 0 for x in size):
            raise CheckpointError(f"{self.path / DCP_METADATA}: key {key} has shape {size}; the file is damaged")
        self._check_axes(key, dist, size)
        dtype = _props_dtype(md.properties)
        itemsize = torch.empty((), dtype=dtype).element_size()
        for c in md.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            if (
                not all(isinstance(x, int) and x >= 0 for x in offsets + sizes)
                or len(sizes) != len(size)
                or len(offsets) != len(size)
                or any(o + s > g for o, s, g in zip(offsets, sizes, size))
            ):
                raise CheckpointError(
                    f"{self.path / DCP_METADATA}: chunk {offsets}+{sizes} of {key} lies "
                    f"outside its shape {size}; the file is damaged"
                )
            where = self._chunk(key, offsets)
            if where.length < math.prod(sizes) * itemsize:  # before anything is allocated for it
                raise CheckpointError(
                    f"{self.path / DCP_METADATA}: chunk {offsets}+{sizes} of {key} declares "
                    f"more elements than its {where.length} stored bytes hold; the file is damaged"
                )
            chunk = _Chunk(key, offsets, sizes, where.file, where.start, where.length)
            ranges = [range(o, o + s) for o, s in zip(offsets[:n], sizes[:n])]
            for index in _product(ranges):
                name = dist.canonical(index)
                entry = self._tensors.setdefault(name, _TensorEntry(key, index, size[n:], dtype))
                entry.chunks.append(chunk)

    def _index_object(self, unique: str) -> None:
        parsed = parse_object_key(unique)
        if parsed is None:
            raise CheckpointError(
                f"{self.path / DCP_METADATA}: object key {unique} lacks the "
                "/shard_<offsets>_<shape> suffix megatron writes; the file is damaged"
            )
        key, offsets = parsed
        dist = parse_dist_key(key, self.local_spec)
        index = offsets[: len(dist.axes)]
        chunk = self._chunk(unique, None)
        self._objects[dist.canonical(index)] = _ObjectEntry(chunk)

    def _check_axes(self, key: str, dist: DistName, size: tuple[int, ...]) -> None:
        expected = {"layer": self._spec.num_layers, "expert": self._spec.num_experts}
        if len(size) <= len(dist.axes):
            raise CheckpointError(
                f"{self.path / DCP_METADATA}: key {key} has shape {size}, too few "
                f"dimensions for its {dist.axes} axes; the file is damaged"
            )
        for kind, n in zip(dist.axes, size):
            if n != expected[kind]:
                what = "num_layers" if kind == "layer" else "num_experts"
                raise CheckpointError(
                    f"{self.path}: key {key} has {n} entries on its {kind} axis but the "
                    f"args in common.pt say {what}={expected[kind]}; common.pt and "
                    ".metadata come from different saves, copy the folder again"
                )

    def _check_files(self) -> None:
        """Every data file exists and is long enough for the chunks it should hold."""
        needed: dict[Path, int] = {}
        for file, start, length in self._storage.values():
            needed[file] = max(needed.get(file, 0), start + length)
        for file, end in sorted(needed.items()):
            if not file.is_file():
                raise CheckpointError(f"{file}: data file missing; copy it from the source checkpoint")
            size = file.stat().st_size
            if size < end:
                raise CheckpointError(
                    f"{file}: holds {size} bytes but .metadata places chunks up to byte "
                    f"{end}; the file is truncated, copy it again from the source"
                )

    def _check_complete(self) -> None:
        import torch

        for name, entry in self._tensors.items():
            n = len(entry.index)
            covered = sum(math.prod(c.sizes[n:]) for c in entry.chunks)
            if covered != math.prod(entry.shape):
                raise CheckpointError(
                    f"{self.path / DCP_METADATA}: chunks of {name} cover {covered} of "
                    f"{math.prod(entry.shape)} elements; the save is incomplete"
                )
            stored = sum(length for _, _, length in {(c.file, c.start, c.length) for c in entry.chunks})
            if math.prod(entry.shape) * torch.empty((), dtype=entry.dtype).element_size() > stored:
                raise CheckpointError(
                    f"{self.path / DCP_METADATA}: {name} declares shape {list(entry.shape)}, more "
                    f"than the {stored} bytes of its chunks hold; the file is damaged"
                )
        for layer_id in self._spec.moe_layer_ids if self._spec.num_experts else ():
            prefix = f"{layer_module_prefix(layer_id)}.mlp.experts."
            found = {n[len(prefix) :].split(".")[0] for n in self._tensors if n.startswith(prefix)}
            if len(found) != self._spec.num_experts:
                raise CheckpointError(
                    f"{self.path}: MoE layer {layer_id} holds {len(found)} experts but args "
                    f"say num_experts={self._spec.num_experts}; the checkpoint is incomplete"
                )

    def _resolve_none_objects(self) -> int:
        """Drop `_extra_state` objects that hold None (local linears), as the legacy reader does;
        returns how many.

        torch.save([None]) is byte-identical within one save, so per key only the first blob and
        blobs of another length are read: thousands of expert objects cost one read.
        """
        by_key: dict[str, list[str]] = {}
        for name, entry in self._objects.items():
            by_key.setdefault(entry.chunk.key.split("/shard_")[0], []).append(name)
        dropped = 0
        for names in by_key.values():
            none_length = None
            for name in names:
                entry = self._objects[name]
                if none_length is None or entry.chunk.length != none_length:
                    if self._object_value(entry) is not None:
                        continue
                    none_length = entry.chunk.length
                del self._objects[name]
                dropped += 1
        return dropped

    def _object_value(self, entry: _ObjectEntry):
        if not entry.loaded:
            entry.value, entry.loaded = _read_object(entry.chunk), True
        return entry.value

    # -- ModelView ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str):
        import torch

        if name in self._objects:
            return self._object_value(self._objects[name])
        entry = self._tensors[name]
        n = len(entry.index)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        for c in entry.chunks:
            local = tuple(i - o for i, o in zip(entry.index, c.offsets))
            inner = c.sizes[n:]
            box = tuple(slice(o, o + s) for o, s in zip(c.offsets[n:], inner))
            out[box] = _read_block(c, local, inner, entry.dtype)
        return out

    def shape(self, name: str):
        return self._tensors[name].shape if name in self._tensors else None

    def dtype(self, name: str):
        return self._tensors[name].dtype if name in self._tensors else None


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i,) + rest
