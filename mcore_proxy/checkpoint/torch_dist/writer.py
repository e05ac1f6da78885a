"""Megatron `torch_dist` checkpoints, written from any ModelView (files: `torch_dist/files.py`).

The files do not depend on the parallel layout: megatron-core's `dist_checkpointing.load`
re-shards them for a model of the view's architecture at any TP/PP/EP/ETP. The expert axis is
the view's (`view.spec.num_experts`, K for a pruned view). The target only sets the parallel
sizes stored in `args` and the chunking (the target's shards, so loading there reads exactly its
bytes). No optimizer or RNG state is written: Megatron's distributed optimizer state saved as
`dp_reshardable` is laid out by the saving run's data-parallel and expert-parallel grid, so it
cannot follow an EP (or expert count) change; resume with `--no-load-optim --no-load-rng` (the
args also say no_save_optim/no_save_rng).

Units: one `__0_{n}.distcp` data file per streaming group of the view (a layer, or the embeddings
and final norms), each returning the chunk records of what it wrote; `finish` builds `.metadata`
from those records (torch's own DCP dataclasses, `torch.distributed.checkpoint.metadata`, public
since torch 2.0, and `filesystem._StorageInfo`, private but unchanged since 2.0, pickled as
`FileSystemWriter.finish` does) and writes `common.pt`; metadata.json and the tracker are the
markers. `dcp.save` itself is not used: it needs the whole state dict in memory at once.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.interface import Finished, Unit, WrittenFile, Writer
from mcore_proxy.checkpoint.iteration import TRACKER, folder_name, header_iteration, tracker_bytes
from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.checkpoint.mindspeed_llm import naming_args
from mcore_proxy.checkpoint.names import KeyStyle, linear_extra_state, object_key
from mcore_proxy.checkpoint.safe_globals import check_writable
from mcore_proxy.checkpoint.target import (
    check_fits,
    checkpoint_version,
    refuse_dsv4_tp,
    refuse_noop_layers,
    target_args,
)
from mcore_proxy.checkpoint.torch_dist.files import (
    BACKEND,
    COMMON_FILE,
    CONFIG,
    CONFIG_FILE,
    CONTENT_METADATA,
    DCP_METADATA,
)
from mcore_proxy.checkpoint.torchfile import save_object
from mcore_proxy.checkpoint.view import ModelView, stream, tensor_nbytes
from mcore_proxy.checkpoint.zipwrite import HashingSink
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.sharding import rule_for

if TYPE_CHECKING:
    import torch


def dist_args(view: ModelView, target: ParallelLayout):
    """common.pt `args`: `target_args`, and `no_save_optim`/`no_save_rng`, which tell Megatron's
    loader there is no optimizer or RNG state to look for, so it loads the weights instead of
    failing on their absence."""
    args = naming_args(target_args(view, target), target)  # megatron names: MindSpeed-LLM's flags off
    args.ckpt_format = BACKEND
    args.no_save_optim = True
    args.no_save_rng = True
    return args


def _write_tensor(sink: HashingSink, key: str, index, sizes, tensor: torch.Tensor, boxes, records) -> None:
    """Every chunk of one tensor as a standalone torch.save blob (a dim-0 chunk straight from the
    tensor's memory); one record per chunk: ("tensor", key, dtype, global size, chunk offsets,
    chunk sizes, byte start, byte length)."""
    size = tuple(sizes) + tuple(tensor.shape)
    lead = (1,) * len(index)
    for offsets, box in boxes:
        piece = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, box))].reshape(lead + box)
        start = sink.position
        save_object(piece, sink=sink)
        records.append(
            (
                "tensor",
                key,
                str(tensor.dtype).removeprefix("torch."),
                size,
                tuple(index) + tuple(offsets),
                lead + box,
                start,
                sink.position - start,
            )
        )


def _write_object(sink: HashingSink, unique: str, value, records) -> None:
    """A ShardedObject as torch.save([value]); record ("object", key, byte start, byte length).
    It may hold Unresolved objects (TE extra state read back): torchfile's pickler keeps them."""
    import torch

    if value is not None and not isinstance(value, torch.Tensor):  # a tensor is data (TE's byte tensor)
        check_writable(value, f"object {unique}")
    start = sink.position
    save_object([value], sink=sink)
    records.append(("object", unique, start, sink.position - start))


def is_extra_state(name: str) -> bool:
    """A module's `_extra_state` entry (opaque bytes or None), written as a ShardedObject."""
    return name.endswith("._extra_state")


def write_group(
    view: ModelView, names: list[str], it_dir: Path, file: str, style: KeyStyle, target: ParallelLayout, progress=None
) -> WrittenFile:
    """One data file: the tensors of one streaming group, one canonical tensor in memory at a time
    (the next ones read ahead: `view.stream`), hashed while written and synced before returning.

    With the view's `linear_extra_state`, every linear weight gets the `_extra_state` object
    (None) megatron's local linears ask for on load, unless the view carries that object itself."""
    import torch

    present, records = set(names), []
    with HashingSink(it_dir / file) as sink:
        for name, value in stream(view, names):
            key, index, sizes = style.locate(name)
            if not isinstance(value, torch.Tensor) or is_extra_state(name):
                # TE's extra state is a byte tensor read from a legacy file, but megatron-core saves
                # every `_extra_state` as a ShardedObject (per expert for experts: renumbered to K)
                _write_object(sink, object_key(key, index, sizes), value, records)
                continue
            rule = rule_for(name, view.layer_spec)
            _write_tensor(
                sink, key, index, sizes, value, rule.chunk_boxes(tuple(value.shape), rule.parts(target)), records
            )
            extra = linear_extra_state(name)
            if view.info.linear_extra_state and extra and extra not in present:
                _write_object(sink, object_key(linear_extra_state(key), index, sizes), None, records)
            if progress is not None:
                progress(value.numel() * value.element_size())
            del value
        size, digest = sink.close()
    return WrittenFile(f"{it_dir.name}/{file}", size, digest, tuple(records))


def dcp_metadata(results: list[list[WrittenFile]]):
    """torch DCP `Metadata` of everything the units wrote, from their records, as FileSystemWriter
    would pickle it."""
    import torch

    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors: dict[str, tuple[str, tuple, list]] = {}
    sd_md, storage = {}, {}
    for written in (f for files in results for f in files):
        file = sys.intern(written.path.rsplit("/", 1)[-1])
        # interned: pickle writes an equal string once and refers back to it only if it is the
        # same object, so without this the bytes would depend on whether the records crossed a
        # process boundary (workers, torchrun ranks) or not
        for record in (tuple(sys.intern(x) if isinstance(x, str) else x for x in r) for r in written.records):
            if record[0] == "object":
                _, unique, start, length = record
                sd_md[unique] = BytesStorageMetadata()
                storage[MetadataIndex(unique, None)] = filesystem._StorageInfo(file, start, length)
                continue
            _, key, dtype, size, offsets, sizes, start, length = record
            entry = tensors.setdefault(key, (dtype, tuple(size), []))
            if entry[:2] != (dtype, tuple(size)):
                raise CheckpointError(
                    f"{key}: chunks of {tuple(size)} {dtype} and {entry[1]} {entry[0]}; every "
                    "layer must have the same shapes and dtypes"
                )
            entry[2].append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(key, torch.Size(offsets))] = filesystem._StorageInfo(file, start, length)
    for key, (dtype, size, chunks) in tensors.items():
        sd_md[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(size), chunks=chunks
        )
    md = Metadata(state_dict_metadata=sd_md, storage_data=storage)
    if hasattr(md, "version") and hasattr(filesystem, "CURRENT_DCP_VERSION"):
        md.version = filesystem.CURRENT_DCP_VERSION
    return md


class DistWriter(Writer):
    """The torch_dist format's Writer (see `checkpoint/interface.py`)."""

    def check(self, view: ModelView, target: ParallelLayout) -> None:
        """`check_fits` (megatron re-shards torch_dist on load), the args it will store, and that
        the layers stacked on one key agree in shape and dtype."""
        refuse_noop_layers(view, "torch_dist")
        check_fits(view, target)
        refuse_dsv4_tp(view, target)
        args = dist_args(view, target)
        checkpoint_version(view)
        style = KeyStyle.from_args(args, view.spec)
        seen: dict[str, tuple] = {}
        for name in view.names():
            key, _, sizes = style.locate(name)
            shape = view.shape(name)
            if shape is None or is_extra_state(name):  # objects: nothing to stack
                continue
            got = (tuple(sizes) + tuple(shape), view.dtype(name))
            if seen.setdefault(key, got) != got:
                raise CheckpointError(
                    f"{name}: {tuple(shape)} {got[1]} does not stack with the other layers' "
                    f"{key} ({seen[key][0][len(sizes) :]} {seen[key][1]}); every layer must "
                    "have the same shapes and dtypes"
                )

    def units(self, view: ModelView, target: ParallelLayout) -> list[Unit]:
        return [
            Unit((n, group), sum(tensor_nbytes(view, name) for name in names))
            for n, (group, names) in enumerate(view.groups().items())
        ]

    def write_unit(
        self, view: ModelView, root: Path, target: ParallelLayout, unit: Unit, progress=None
    ) -> list[WrittenFile]:
        n, group = unit.key
        it_dir = Path(root) / folder_name(view.iteration)
        it_dir.mkdir(exist_ok=True)
        style = KeyStyle.from_args(dist_args(view, target), view.spec)
        return [write_group(view, view.groups()[group], it_dir, f"__0_{n}.distcp", style, target, progress)]

    def finish(self, view: ModelView, root: Path, target: ParallelLayout, results) -> Finished:
        sub = folder_name(view.iteration)
        it_dir = Path(root) / sub
        it_dir.mkdir(exist_ok=True)
        with HashingSink(it_dir / DCP_METADATA) as sink:
            sink.write(pickle.dumps(dcp_metadata(results)))
            metadata = sink.close()
        common = {
            "args": dist_args(view, target),
            "checkpoint_version": checkpoint_version(view),
            "iteration": header_iteration(view.iteration),
            "content_metadata": dict(CONTENT_METADATA),
        }
        written = save_object(common, it_dir / COMMON_FILE)
        files = (
            WrittenFile(f"{sub}/{DCP_METADATA}", *metadata),
            WrittenFile(f"{sub}/{COMMON_FILE}", written.size, written.sha256),
        )
        # metadata.json marks the iteration complete for megatron-core, the tracker the checkpoint
        return Finished(
            files, {f"{sub}/{CONFIG_FILE}": json.dumps(CONFIG).encode(), TRACKER: tracker_bytes(view.iteration)}
        )
