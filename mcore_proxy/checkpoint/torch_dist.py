"""Megatron `torch_dist` checkpoints: read as a canonical ModelView, write from any ModelView.

One iteration folder (megatron-core 0.16.1, checked by saving real models on CPU):
  metadata.json   `{"sharded_backend": "torch_dist", ...}`, written last: without it the save
                  did not finish
  common.pt       torch.save of everything not sharded: `args`, `iteration`,
                  `checkpoint_version`, `content_metadata` (flags of `sharded_state_dict`)
  .metadata       pickled PyTorch DCP `Metadata`: per key the global shape, dtype and chunk
                  boxes; `storage_data` maps each chunk to (file, byte offset, byte length)
  __R_N.distcp    data files; every chunk is a standalone torch.save blob at its offset

Keys are ShardedTensor keys, not module names:
  - a homogeneous decoder stacks its layers on a prepended axis (`decoder.layers.mlp.router.weight`
    [L, E, H]); with `moe_layer_freq` a list or an int > 1, keys are per layer
    (`decoder.layers.{L}.mlp.router.weight` [E, H]); MTP layers are always per layer;
  - routed experts add an expert axis: `...mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]
    (fc1 = all gate rows, then all up rows); SequentialMLP, GroupedMLP and TEGroupedMLP save the
    same keys, so the files do not depend on the expert module nor on TP/PP/EP;
  - the local (non-TE, non-MLA) layer spec saves `input_layernorm.*` / `pre_mlp_layernorm.*` under
    the keys of TE's fused norms (`self_attention.linear_qkv.layer_norm_*`,
    `mlp.linear_fc1.layer_norm_*`), so both specs share one layout;
  - `_extra_state` of linears are ShardedObjects `KEY/shard_{offsets}_{shape}` over the prepended
    axes (`shard_0_1` when there are none), each a torch.save of `[value]` (`[None]` for local
    linears).

Reading never runs foreign code: `.metadata` goes through a restricted unpickler that keeps every
class as inert data, `common.pt` and the chunks through torchfile's restricted reader. Neither
`torch.load` nor `FileSystemReader.read_metadata()` (a plain `pickle.load`) is used, and no
process group is needed. Writing builds the DCP metadata with torch's own dataclasses
(`torch.distributed.checkpoint.metadata`, public since torch 2.0, and `filesystem._StorageInfo`,
private but unchanged since 2.0) and pickles it as `FileSystemWriter.finish` does; `dcp.save`
itself is not used because it needs the whole state dict in memory at once.
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import io
import json
import math
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from mcore_proxy.checkpoint.layer_spec import infer_layer_spec
from mcore_proxy.checkpoint.layout import ParallelLayout, check_fits, stage_layer_counts
from mcore_proxy.checkpoint.names import GROUPED, LINEAR_WEIGHT, SEQUENTIAL, TE_GROUPED
from mcore_proxy.checkpoint.safe_globals import check_writable, writable_args
from mcore_proxy.checkpoint.torchfile import (UNREADABLE, LazyTensor, TorchFile, WriteSink, brief_error, materialize,
                                              save_object, unpickle_torch_zip, unresolved_class)
from mcore_proxy.checkpoint.view import ModelView, tensor_nbytes
from mcore_proxy.errors import CheckpointError, ProxyError
from mcore_proxy.layer_pattern import parse_layer_pattern
from mcore_proxy.megatron_args import DEFAULTS, arg, arg_int
from mcore_proxy.sharding import GLU_COLUMN, REPLICATED, ROW, rule_for
from mcore_proxy.spec import ModelSpec, layer_module_prefix
from mcore_proxy.units import BYTES_PROGRESS

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG_FILE = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_FILE = "common.pt"
BACKEND = "torch_dist"
CONFIG = {"sharded_backend": BACKEND, "sharded_backend_version": 1,
          "common_backend": "torch", "common_backend_version": 1}
# The `sharded_state_dict` flags Megatron reads back from common.pt before loading; False is the
# layout described above (True splits experts and GLU halves into separate keys).
CONTENT_METADATA = {"singleton_local_shards": False}


# -- key mapping: torch_dist keys <-> canonical names (data first) -------------------------------

# (canonical module prefix, torch_dist key prefix) inside a layer, for megatron's local layer spec
# (its `sharded_state_dict_keys_map`): its separate norms are saved under TE's fused-norm keys.
LOCAL_SPEC_RENAMES: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
# Keys in a training checkpoint that are not model weights: deliberately not in the view.
IGNORED_KEYS: tuple[str, ...] = (r"^optimizer[./]", r"^rng_state$", r"^rerun_state_machine",
                                 r"\.local_tokens_per_expert$")
_IGNORED = tuple(re.compile(p) for p in IGNORED_KEYS)

_DIST_DECODER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.*)$")
_CANON_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.*)$")
_DIST_EXPERTS = "mlp.experts.experts."
_CANON_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.*)$")
_OBJECT_KEY = re.compile(r"^(.*)/shard_([\d.]*)_([\d.]*)$")


def _rename(rest: str, local_spec: bool, to_dist: bool) -> str:
    if not local_spec:
        return rest
    for canon, dist in LOCAL_SPEC_RENAMES:
        src, dst = (canon, dist) if to_dist else (dist, canon)
        if rest.startswith(src):
            return dst + rest[len(src):]
    return rest


@dataclass(frozen=True)
class DistName:
    """A torch_dist key seen from the canonical side.

    template: the canonical name with `{layer}` / `{expert}` holes for the prepended axes;
    axes: the kinds of the prepended axes in order (`("layer", "expert")`, `("expert",)`, `()`).
    """

    template: str
    axes: tuple[str, ...]

    def canonical(self, index: tuple[int, ...]) -> str:
        name = self.template
        for kind, i in zip(self.axes, index):
            name = name.replace("{" + kind + "}", str(i))
        return name


@lru_cache(maxsize=None)
def parse_dist_key(key: str, local_spec: bool) -> DistName:
    """torch_dist key -> canonical template and prepended axes."""
    if m := _DIST_DECODER.match(key):
        layer, rest = m.groups()
        prefix = f"decoder.layers.{layer}." if layer is not None else "decoder.layers.{layer}."
        axes: tuple[str, ...] = () if layer is not None else ("layer",)
    elif m := _MTP.match(key):
        (prefix, rest), axes = m.groups(), ()
    else:
        return DistName(key, ())
    if rest.startswith(_DIST_EXPERTS):
        return DistName(prefix + "mlp.experts.{expert}." + rest[len(_DIST_EXPERTS):], axes + ("expert",))
    return DistName(prefix + _rename(rest, local_spec, to_dist=False), axes)


@dataclass(frozen=True)
class KeyStyle:
    """How one model's canonical names become torch_dist keys (decided by its args).

    stacked: homogeneous decoder, layers on a prepended axis of size num_layers;
    local_spec: megatron's local layer spec (norms under TE fused-norm keys);
    num_experts: size of the expert axis (K for a pruned view).
    """

    stacked: bool
    local_spec: bool
    num_layers: int
    num_experts: int

    @classmethod
    def from_args(cls, args, spec: ModelSpec) -> "KeyStyle":
        return cls(stacked=homogeneous_layers(args), local_spec=uses_local_spec(args),
                   num_layers=spec.num_layers, num_experts=spec.num_experts)

    def locate(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """Canonical name -> (torch_dist key, index on the prepended axes, their sizes)."""
        index: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        if m := _CANON_DECODER.match(name):
            layer, rest = int(m.group(1)), m.group(2)
            if self.stacked:
                prefix, index, sizes = "decoder.layers.", (layer,), (self.num_layers,)
            else:
                prefix = f"decoder.layers.{layer}."
        elif m := _MTP.match(name):
            prefix, rest = m.groups()
        else:
            return name, (), ()
        if e := _CANON_EXPERT.match(rest):
            expert = int(e.group(1))
            if expert >= self.num_experts:
                raise CheckpointError(f"{name}: expert {expert} but the view has num_experts="
                                      f"{self.num_experts}; number kept experts 0..K-1")
            return prefix + _DIST_EXPERTS + e.group(2), index + (expert,), sizes + (self.num_experts,)
        return prefix + _rename(rest, self.local_spec, to_dist=True), index, sizes


def homogeneous_layers(args) -> bool:
    """Whether megatron's TransformerBlock stacks layers on one axis (its `non_homogeneous_layers`
    test): no `moe_layer_freq` / `linear_attention_freq` list or int > 1, no heterogeneous specs."""
    for attr in ("moe_layer_freq", "linear_attention_freq"):
        # MindSpeed/Megatron accept "([0]*3+[1]*58)" strings: the safe parser, never eval
        value = parse_layer_pattern(arg(args, attr), f"args {attr}")
        if isinstance(value, list) or (isinstance(value, int) and value > 1):
            return False
    if arg(args, "heterogeneous_layers_config_path") or arg(args, "heterogeneous_layers_config_encoded_json"):
        return False
    return True


def uses_local_spec(args) -> bool:
    """Megatron's local layer spec (not TE) without MLA renames its norms' sharded keys."""
    return arg(args, "transformer_impl") == "local" and not arg(args, "multi_latent_attention")


def object_key(key: str, index: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """ShardedObject unique key: offsets and shape over the prepended axes, (0,)/(1,) if none."""
    offsets = ".".join(map(str, index)) if index else "0"
    shape = ".".join(map(str, sizes)) if sizes else "1"
    return f"{key}/shard_{offsets}_{shape}"


# -- locating the iteration folder ------------------------------------------------------------

def _has_markers(folder: Path) -> bool:
    return folder.is_dir() and ((folder / CONFIG_FILE).is_file() or (folder / DCP_METADATA).is_file()
                                or (folder / COMMON_FILE).is_file() or any(folder.glob("*.distcp")))


def _tracker_target(path: Path) -> Path | None:
    tracker = path / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_bytes()[:4096].decode("utf-8", "replace").strip()
    return path / ("release" if text == "release" else f"iter_{int(text):07d}") if text.isdigit() or \
        text == "release" else None


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
    target = _tracker_target(path)
    if target is not None:
        return _is_dist_folder(target)
    return _is_dist_folder(path)


def resolve_dist_dir(path) -> tuple[Path, int | str]:
    """Checkpoint root (with tracker) or an iteration folder -> (iteration folder, iteration):
    the legacy rules and messages, with torch_dist's files marking an iteration folder."""
    from mcore_proxy.checkpoint.legacy import resolve_iteration_dir

    return resolve_iteration_dir(
        path, _has_markers, f"not a torch_dist checkpoint (no {CONFIG_FILE}, {DCP_METADATA} or *.distcp "
        "files); pass the folder Megatron saved with --ckpt-format torch_dist")


# -- reading .metadata without running foreign code -------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return unresolved_class(module, name)


def read_dcp_metadata(path: Path):
    """The `.metadata` file as records: `.state_dict_metadata`, `.storage_data` (dicts)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the torch_dist save did not finish or the file was "
                              "lost, copy the iteration folder again from the source")
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
        sd_md, storage = md.state_dict_metadata, md.storage_data
    except UNREADABLE as err:
        raise CheckpointError(f"{path}: not a readable PyTorch DCP metadata file ({brief_error(err)}); it is "
                              "truncated or damaged, copy it again from the source") from None
    if not isinstance(sd_md, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path}: holds no key table; it is damaged, copy it again from the source")
    return sd_md, storage


def _byte_count(value, path: Path, key) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: storage entry of {str(key)[:60]} has byte offset or length "
                              f"{str(value)[:40]}; the file is damaged, copy it again")
    return value


def _props_dtype(props) -> torch.dtype:
    """TensorProperties pickles as a tuple (dtype, layout, ...) since torch 2.0, a dict before."""
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
        return CheckpointError(f"{c.file}: the chunk of {c.key} at byte {c.start} is not a readable torch.save "
                               f"blob ({why}); the file is damaged, copy it again from the source")

    def read_elements(self, storage, start: int, count: int) -> torch.Tensor:
        """`count` elements from element `start` of a storage (the LazyTensor protocol)."""
        item = torch.empty((), dtype=storage.dtype).element_size()
        try:
            info = self._zip.getinfo(storage.member)
        except KeyError:
            raise self._damaged(f"no member {storage.member}") from None
        if info.compress_type != zipfile.ZIP_STORED or info.file_size < storage.numel * item \
                or start + count > storage.numel:
            raise self._damaged(f"member {storage.member} does not hold its {storage.numel} elements")
        window = _Window(self._fh, self._chunk.start, self._chunk.length)
        window.seek(info.header_offset)
        header = window.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise self._damaged(f"bad local header of {storage.member}")
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        window.seek(info.header_offset + 30 + name_len + extra_len + start * item)
        out = torch.empty(count, dtype=storage.dtype)
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
            raise CheckpointError(f"{chunk.file}: chunk of {chunk.key} at byte {chunk.start} holds {got}, "
                                  f"metadata says {chunk.sizes} {dtype}; the file does not belong to "
                                  "this .metadata, copy the folder again")
        start = 0  # row-major position of `local` on the prepended axes, in blocks
        for i, n in zip(local, chunk.sizes[:len(local)]):
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
        raise CheckpointError(f"{chunk.file}: object {chunk.key} is not a saved [value] list; the file "
                              "is damaged, copy it again")
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
        raise CheckpointError(f"{path}: missing; Megatron writes args and iteration there, copy it from "
                              "the source checkpoint")
    common = TorchFile(path).obj
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}: holds {type(common).__name__}, not Megatron's common state dict")
    return common


def _check_config(it_dir: Path) -> None:
    path = it_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so the torch_dist save did not complete (Megatron writes "
                              "it last); use a checkpoint whose save finished")
    try:
        backend = json.loads(path.read_bytes()).get("sharded_backend")
    except (ValueError, OSError, AttributeError, RecursionError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); copy it again from the source") from None
    if backend != BACKEND:
        raise CheckpointError(f"{path}: sharded backend {backend!r} is not supported, only {BACKEND!r}; "
                              "re-save the checkpoint with --ckpt-format torch_dist")


def _layout_of(args, where: Path) -> ParallelLayout:
    """The saving run's layout (informational: torch_dist files do not depend on it)."""
    from mcore_proxy.checkpoint.legacy import _layout_from_args

    if arg(args, "moe_grouped_gemm"):
        te = arg(args, "transformer_impl") == "transformer_engine"
        expert_layout = TE_GROUPED if te and not arg(args, "moe_use_legacy_grouped_gemm") else GROUPED
    else:
        expert_layout = SEQUENTIAL
    try:
        base = _layout_from_args(args, where)
    except ProxyError:  # e.g. pipeline_model_parallel_layout: keep sizes, no stage split
        size = lambda n: arg_int(args, n, str(where), minimum=1, maximum=1 << 20)  # noqa: E731
        tp = size("tensor_model_parallel_size") or 1
        base = ParallelLayout(tp=tp, pp=size("pipeline_model_parallel_size") or 1,
                              ep=size("expert_model_parallel_size") or 1,
                              etp=size("expert_tensor_parallel_size") or tp)
    return dataclasses.replace(base, expert_layout=expert_layout)


class TorchDistCheckpoint(ModelView):
    """A Megatron torch_dist checkpoint as a canonical ModelView.

    Opening reads metadata.json, common.pt and `.metadata` only; `get(name)` reads the chunks
    that make up that tensor (for an expert of a GroupedMLP chunk, only that expert's bytes).
    """

    format = "torch_dist"

    def __init__(self, path):
        self.path, self.iteration = resolve_dist_dir(path)
        _check_config(self.path)
        common = _read_common(self.path)
        self.args = common.get("args")
        if self.args is None:
            raise CheckpointError(f"{self.path / COMMON_FILE}: no 'args' entry; mcore-proxy needs the args "
                                  "Megatron saves (was the checkpoint written with --no-save-args?)")
        if isinstance(self.iteration, str) and self.iteration != "release" and \
                isinstance(common.get("iteration"), int):
            self.iteration = common["iteration"]  # a folder not named iter_*: trust common.pt
        self.checkpoint_version = common.get("checkpoint_version")
        content = common.get("content_metadata") or {}
        if not isinstance(content, dict):
            raise CheckpointError(f"{self.path / COMMON_FILE}: content_metadata is a {type(content).__name__}, "
                                  "not Megatron's dict of flags; the file is damaged, copy it again")
        self.content_metadata = dict(content)
        if self.content_metadata.get("singleton_local_shards"):
            raise CheckpointError(f"{self.path}: saved with singleton_local_shards (one key per expert and "
                                  "GLU half), which is not supported yet; re-save without it")
        self.spec = ModelSpec.from_args(self.args, where=str(self.path / COMMON_FILE))
        self.layout = _layout_of(self.args, self.path)
        self.local_spec = uses_local_spec(self.args)
        self.linear_extra_state = False
        self.variants: set[str] = set()
        sd_md, storage = read_dcp_metadata(self.path / DCP_METADATA)
        self.layer_spec = infer_layer_spec(self.args, dict.fromkeys(sd_md), 1, str(self.path / COMMON_FILE))
        self._storage = self._index_storage(storage)
        self._tensors: dict[str, _TensorEntry] = {}
        self._objects: dict[str, _ObjectEntry] = {}
        self._index_metadata(sd_md)
        self._check_files()
        self._check_complete()
        self._resolve_none_objects()
        for name in list(self._tensors) + list(self._objects):
            rule_for(name, self.layer_spec)  # a name no sharding rule knows is an error, never silently kept
        from mcore_proxy.checkpoint.legacy import canonical_sort_key

        self._names = sorted(list(self._tensors) + list(self._objects), key=canonical_sort_key)

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
                raise CheckpointError(f"{md_path}: storage table entry without {err}; the file is damaged, "
                                      "copy it again") from None
            if not isinstance(fqn, str) or not all(isinstance(o, int) for o in offset or ()):
                raise CheckpointError(f"{md_path}: storage table entry {str(fqn)[:60]} is damaged; copy the "
                                      "file again")
            out[(fqn, offset)] = (self._data_file(name), _byte_count(start, md_path, fqn),
                                  _byte_count(length, md_path, fqn))
            if transforms:
                raise CheckpointError(f"{md_path}: chunks are stored with transforms "
                                      f"{transforms} (compression), which is not supported; re-save without")
        return out

    def _data_file(self, name) -> Path:
        """A data file named by `.metadata`, confined to this iteration folder."""
        bad = (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
               or "\0" in name or Path(name).is_absolute())
        if bad:
            raise CheckpointError(f"{self.path / DCP_METADATA}: names the data file {str(name)[:80]!r}, which "
                                  "is not a file of this folder; the metadata is damaged or hostile, copy the "
                                  "checkpoint again from its source")
        return self.path / name

    def _index_metadata(self, sd_md: dict) -> None:
        """Index every key of `.metadata`; records of the wrong shape are one sentence, not a crash."""
        try:
            for key, md in sd_md.items():
                if not isinstance(key, str):
                    raise CheckpointError(f"{self.path / DCP_METADATA}: key {str(key)[:60]} is not a string; "
                                          "the file is damaged, copy it again")
                if any(p.search(key.split("/shard_")[0]) for p in _IGNORED):
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
            raise CheckpointError(f"{self.path / DCP_METADATA}: a key record is damaged ({brief_error(err)}); "
                                  "copy the file again from the source") from None

    def _chunk(self, key: str, offsets) -> _Chunk:
        where = self._storage.get((key, offsets))
        if where is None:
            raise CheckpointError(f"{self.path / DCP_METADATA}: no storage entry for {key} at {offsets}; "
                                  "the file is damaged, copy it again")
        return _Chunk(key, offsets or (), (), *where)

    def _index_tensor(self, key: str, md) -> None:
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
            if not all(isinstance(x, int) and x >= 0 for x in offsets + sizes) or len(sizes) != len(size) or \
                    len(offsets) != len(size) or any(o + s > g for o, s, g in zip(offsets, sizes, size)):
                raise CheckpointError(f"{self.path / DCP_METADATA}: chunk {offsets}+{sizes} of {key} lies "
                                      f"outside its shape {size}; the file is damaged")
            where = self._chunk(key, offsets)
            if where.length < math.prod(sizes) * itemsize:  # before anything is allocated for it
                raise CheckpointError(f"{self.path / DCP_METADATA}: chunk {offsets}+{sizes} of {key} declares "
                                      f"more elements than its {where.length} stored bytes hold; the file is damaged")
            chunk = _Chunk(key, offsets, sizes, where.file, where.start, where.length)
            ranges = [range(o, o + s) for o, s in zip(offsets[:n], sizes[:n])]
            for index in _product(ranges):
                name = dist.canonical(index)
                entry = self._tensors.setdefault(name, _TensorEntry(key, index, size[n:], dtype))
                entry.chunks.append(chunk)

    def _index_object(self, unique: str) -> None:
        m = _OBJECT_KEY.match(unique)
        if not m:
            raise CheckpointError(f"{self.path / DCP_METADATA}: object key {unique} lacks the "
                                  "/shard_<offsets>_<shape> suffix megatron writes; the file is damaged")
        key, offsets = m.group(1), tuple(int(x) for x in m.group(2).split(".") if x)
        dist = parse_dist_key(key, self.local_spec)
        index = offsets[:len(dist.axes)]
        chunk = self._chunk(unique, None)
        self._objects[dist.canonical(index)] = _ObjectEntry(chunk)

    def _check_axes(self, key: str, dist: DistName, size: tuple[int, ...]) -> None:
        expected = {"layer": self.spec.num_layers, "expert": self.spec.num_experts}
        if len(size) <= len(dist.axes):
            raise CheckpointError(f"{self.path / DCP_METADATA}: key {key} has shape {size}, too few "
                                  f"dimensions for its {dist.axes} axes; the file is damaged")
        for kind, n in zip(dist.axes, size):
            if n != expected[kind]:
                what = "num_layers" if kind == "layer" else "num_experts"
                raise CheckpointError(f"{self.path}: key {key} has {n} entries on its {kind} axis but the "
                                      f"args in common.pt say {what}={expected[kind]}; common.pt and "
                                      ".metadata come from different saves, copy the folder again")

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
                raise CheckpointError(f"{file}: holds {size} bytes but .metadata places chunks up to byte "
                                      f"{end}; the file is truncated, copy it again from the source")

    def _check_complete(self) -> None:
        for name, entry in self._tensors.items():
            n = len(entry.index)
            covered = sum(math.prod(c.sizes[n:]) for c in entry.chunks)
            if covered != math.prod(entry.shape):
                raise CheckpointError(f"{self.path / DCP_METADATA}: chunks of {name} cover {covered} of "
                                      f"{math.prod(entry.shape)} elements; the save is incomplete")
            stored = sum(length for _, _, length in {(c.file, c.start, c.length) for c in entry.chunks})
            if math.prod(entry.shape) * torch.empty((), dtype=entry.dtype).element_size() > stored:
                raise CheckpointError(f"{self.path / DCP_METADATA}: {name} declares shape {list(entry.shape)}, more "
                                      f"than the {stored} bytes of its chunks hold; the file is damaged")
        for layer_id in self.spec.moe_layer_ids if self.spec.num_experts else ():
            prefix = f"{layer_module_prefix(layer_id)}.mlp.experts."
            found = {n[len(prefix):].split(".")[0] for n in self._tensors if n.startswith(prefix)}
            if len(found) != self.spec.num_experts:
                raise CheckpointError(f"{self.path}: MoE layer {layer_id} holds {len(found)} experts but args "
                                      f"say num_experts={self.spec.num_experts}; the checkpoint is incomplete")

    def _resolve_none_objects(self) -> None:
        """Drop `_extra_state` objects that hold None (local linears), as the legacy reader does.

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
        # writers re-create None extra states for every linear of the target modules
        self.linear_extra_state = dropped > 0

    def _object_value(self, entry: _ObjectEntry):
        if not entry.loaded:
            entry.value, entry.loaded = _read_object(entry.chunk), True
        return entry.value

    # -- ModelView ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str):
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


# -- the writer -------------------------------------------------------------------------------

def chunk_boxes(shape: tuple[int, ...], rule, parts: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the chunks one canonical tensor is written as: its shards at `parts`
    ranks (gate and up halves apart for GLU), so a load at that layout reads exactly its bytes;
    loads at other layouts read overlapping chunks (DCP re-shards). One chunk if not divisible."""
    if parts == 1 or rule.kind == REPLICATED or not shape:
        return [((0,) * len(shape), tuple(shape))]
    dim = 1 if rule.kind == ROW else 0
    pieces = parts * 2 if rule.kind == GLU_COLUMN else parts
    if len(shape) <= dim or shape[dim] % pieces:
        return [((0,) * len(shape), tuple(shape))]
    step = shape[dim] // pieces
    boxes = []
    for p in range(pieces):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = p * step, step
        boxes.append((tuple(offsets), tuple(sizes)))
    return boxes


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage: give each chunk a storage of its own."""
    t = t.detach().cpu().contiguous()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


@dataclass
class _KeyOut:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


class _DcpWriter:
    """Streams chunks into .distcp files and keeps the (small) metadata of what it wrote."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.tensors: dict[str, _KeyOut] = {}
        self.objects: list[str] = []
        self.storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}

    def add_tensor(self, fh, file: str, name: str, key: str, index, sizes, tensor: torch.Tensor, boxes) -> None:
        size = tuple(sizes) + tuple(tensor.shape)
        out = self.tensors.setdefault(key, _KeyOut(tensor.dtype, size))
        if (out.dtype, out.size) != (tensor.dtype, size):
            raise CheckpointError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} does not stack with the other "
                                  f"layers' {key} ({out.size[len(sizes):]} {out.dtype}); every layer must have "
                                  "the same shapes and dtypes")
        lead = (1,) * len(index)
        for offsets, box in boxes:
            piece = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, box))].reshape(lead + box)
            start = fh.tell()
            torch.save(_standalone(piece), fh)
            fh.check()
            full = tuple(index) + tuple(offsets)
            out.chunks.append((full, lead + box))
            self.storage[(key, full)] = (file, start, fh.tell() - start)

    def add_object(self, fh, file: str, unique: str, value) -> None:
        start = fh.tell()
        if value is None:
            torch.save([None], fh)
        else:  # may hold Unresolved objects (TE extra state read back): torchfile's pickler
            check_writable(value, f"object {unique}")
            tmp = self.folder / ".object.tmp"
            save_object([value], tmp)
            fh.write(tmp.read_bytes())
            tmp.unlink()
        fh.check()
        self.objects.append(unique)
        self.storage[(unique, None)] = (file, start, fh.tell() - start)

    def metadata(self):
        """torch DCP `Metadata` of everything written, as FileSystemWriter would pickle it."""
        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, TensorProperties, TensorStorageMetadata)

        sd_md = {}
        for key, out in self.tensors.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in out.chunks]
            sd_md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=out.dtype),
                                               size=torch.Size(out.size), chunks=chunks)
        for unique in self.objects:
            sd_md[unique] = BytesStorageMetadata()
        storage = {MetadataIndex(fqn, None if off is None else torch.Size(off)):
                   filesystem._StorageInfo(file, start, length)
                   for (fqn, off), (file, start, length) in self.storage.items()}
        md = Metadata(state_dict_metadata=sd_md, storage_data=storage)
        if hasattr(md, "version") and hasattr(filesystem, "CURRENT_DCP_VERSION"):
            md.version = filesystem.CURRENT_DCP_VERSION
        return md


def dist_target_args(view: ModelView, target: ParallelLayout | None):
    """common.pt `args`: the source args with the view's experts/router (and the target layout).

    `no_save_optim`/`no_save_rng` tell Megatron's loader there is no optimizer or RNG state to
    look for, so it loads the weights instead of failing on their absence.
    """
    if view.args is None:
        raise CheckpointError("the source has no Megatron args; a torch_dist checkpoint stores them in "
                              "common.pt, so convert from a checkpoint that has them")
    if target is not None:
        from mcore_proxy.checkpoint.legacy import target_args

        args = target_args(view, target)
    else:
        spec = view.spec
        args = writable_args(view.args, needed=DEFAULTS)
        for key, value in dict(num_experts=spec.num_experts or None, moe_router_topk=spec.topk,
                               moe_router_num_groups=spec.num_groups,
                               moe_router_group_topk=spec.group_topk).items():
            setattr(args, key, value)
    args.ckpt_format = BACKEND
    args.no_save_optim = True
    args.no_save_rng = True
    return args


def check_dist_target(view: ModelView, target: ParallelLayout) -> None:
    """Whether megatron can build the view at `target` (it re-shards torch_dist on load)."""
    check_fits(view, target)


def _complete_target(view: ModelView, target: ParallelLayout | None) -> ParallelLayout | None:
    if target is None or target.stage_layers is not None:
        return target
    counts = stage_layer_counts(view.spec.num_layers, target.pp, where="target pipeline split")
    return ParallelLayout(tp=target.tp, pp=target.pp, ep=target.ep, etp=target.etp, vpp=target.vpp,
                          expert_layout=target.expert_layout, stage_layers=counts)


def _write_group(view: ModelView, names: list[str], fh, file: str, writer: _DcpWriter, style: KeyStyle,
                 target: ParallelLayout | None, extra_state: bool, progress) -> None:
    """Write one streaming unit (a layer, or the embeddings and final norms), one tensor at a time.

    With `extra_state`, every linear weight gets the `_extra_state` object (None) megatron's local
    linears ask for on load, unless the view carries that object itself.
    """
    present = set(names)
    for name in names:
        value = view.get(name)
        key, index, sizes = style.locate(name)
        if not isinstance(value, torch.Tensor):
            writer.add_object(fh, file, object_key(key, index, sizes), value)
            continue
        rule = rule_for(name, view.layer_spec)
        parts = 1 if target is None else (target.etp if rule.group == "etp" else target.tp)
        writer.add_tensor(fh, file, name, key, index, sizes, value, chunk_boxes(tuple(value.shape), rule, parts))
        extra = name[:-len(".weight")] + "._extra_state"
        if extra_state and LINEAR_WEIGHT.match(name) and extra not in present:
            writer.add_object(fh, file, object_key(key[:-len(".weight")] + "._extra_state", index, sizes), None)
        if progress is not None:
            progress.update(value.numel() * value.element_size())
        del value


def write_torch_dist(view: ModelView, out, target: ParallelLayout | None = None, *, inputs=(),
                     progress=True) -> Path:
    """Write `view` as a Megatron torch_dist checkpoint into `out` (created; must not exist).

    The files do not depend on the parallel layout: megatron-core's `dist_checkpointing.load`
    re-shards them for a model of the view's architecture at any TP/PP/EP/ETP. The expert axis is
    the view's (`view.spec.num_experts`, K for a pruned view). `target` only sets the parallel
    sizes stored in `args` and the chunking (the target's shards, so loading there reads exactly
    its bytes); its feasibility is checked before a byte is written.

    Streaming: one canonical tensor in memory at a time, one .distcp file per layer. Output goes
    to a hidden temporary folder renamed at the end; inside the iteration folder metadata.json is
    written last, then the tracker beside it. No optimizer or RNG state is written: Megatron's
    distributed optimizer state saved as `dp_reshardable` is laid out by the saving run's
    data-parallel and expert-parallel grid, so it cannot follow an EP (or expert count) change;
    resume with `--no-load-optim --no-load-rng` (args here also say no_save_optim/no_save_rng).
    """
    from tqdm import tqdm

    from mcore_proxy.checkpoint.output import staged_output, write_markers

    target = _complete_target(view, target)
    if target is not None:
        check_dist_target(view, target)
    total = sum(tensor_nbytes(view, n) for n in view.names())
    with staged_output(out, inputs, check_space=False) as tmp, \
            tqdm(total=total, **BYTES_PROGRESS, mininterval=2, desc="write torch_dist",
                 disable=not progress) as bar:
        write_markers(tmp, write_torch_dist_into(view, tmp, target, bar))
    return Path(out)


def write_torch_dist_into(view: ModelView, root: Path, target: ParallelLayout | None,
                          progress=None) -> dict[str, bytes]:
    """The body of `write_torch_dist`: write into the existing (empty, staged) folder `root`.

    Returns the completeness markers, not yet written (relative path -> bytes, in order):
    metadata.json, then the tracker. The caller writes them last (after its manifest)."""
    target = _complete_target(view, target)
    if target is not None:
        check_dist_target(view, target)
    args = dist_target_args(view, target)
    style = KeyStyle.from_args(args, view.spec)
    iteration = view.iteration if view.iteration is not None else 0
    sub = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    from mcore_proxy.checkpoint.legacy import checkpoint_version

    common = {"args": args, "checkpoint_version": checkpoint_version(view),
              "iteration": 0 if iteration == "release" else iteration,
              "content_metadata": dict(CONTENT_METADATA)}
    extra_state = bool(getattr(view, "linear_extra_state", True))
    it_dir = Path(root) / sub
    it_dir.mkdir()
    writer = _DcpWriter(it_dir)
    for n, names in enumerate(view.groups().values()):
        file = f"__0_{n}.distcp"
        with contextlib.closing(WriteSink(it_dir / file)) as fh:
            _write_group(view, names, fh, file, writer, style, target, extra_state, progress)
        fh.check()  # closing fsyncs: errors reported only at writeback show here
    with contextlib.closing(WriteSink(it_dir / DCP_METADATA)) as fh:
        pickle.dump(writer.metadata(), fh)
    fh.check()
    save_object(common, it_dir / COMMON_FILE)
    # metadata.json marks the iteration complete for megatron-core, the tracker the checkpoint
    return {f"{sub}/{CONFIG_FILE}": json.dumps(CONFIG).encode(), TRACKER: str(iteration).encode()}
