"""Writer: any canonical ModelView as a Hugging Face folder that transformers and vLLM load.

Output: shards `model-{i:05d}-of-{n:05d}.safetensors` (per-expert Hub names, as `save_pretrained`
writes), `config.json` (the source's with the view's expert count, top-k and routing groups, or
one made from Megatron args), the source's generation config and tokenizer files copied, and
`model.safetensors.index.json` last: the index is what makes the folder a sharded checkpoint, so
it is the completeness marker.

Units are shards (`units` plans them from shapes alone; `write_unit` streams one, reading each
canonical tensor once and writing its HF pieces; `finish` writes the small files and returns
the index to be written last). Shards are filled in canonical order up to the source's largest
shard size (HF sources) or transformers' historical default of 5 GB.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.hf.descriptor import MoEFamily
from mcore_proxy.checkpoint.hf.mapping import (
    GLU,
    MTP,
    PICK,
    QKV,
    ROPE_LAST,
    SCALE_SUFFIX,
    Row,
    canonical_name,
    glu_split,
    hf_name,
    qkv_split,
    rope_last,
    split_canonical,
)
from mcore_proxy.checkpoint.hf.native_writer import native_outputs, native_source
from mcore_proxy.checkpoint.hf.native_writer import proxy_config as native_proxy_config
from mcore_proxy.checkpoint.hf.folder import INDEX
from mcore_proxy.checkpoint.hf.reader import hf_source
from mcore_proxy.checkpoint.hf.safetensors_io import StreamingWriter
from mcore_proxy.checkpoint.interface import Finished, TargetOptions, Unit, WrittenFile, Writer
from mcore_proxy.checkpoint.names import OUTPUT_LAYER, embeddings_tied
from mcore_proxy.checkpoint.view import ModelView, stream
from mcore_proxy.checkpoint.zipwrite import HashingSink
from mcore_proxy.core.dtypes import torch_dtype
from mcore_proxy.core.errors import CheckpointError, ProxyError

if TYPE_CHECKING:
    import torch

DEFAULT_SHARD_BYTES = 5 * 10**9
CONFIG_FILES = ("generation_config.json",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class Out:
    """One output tensor: HF `key`, read from canonical `source`, piece `piece` of its split;
    `gather`: the canonical tensors concatenated after it (the other elements of a pick row's HF tensor)."""

    key: str
    source: str
    piece: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    gather: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        import torch

        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Shard:
    """One output file and the tensors in it, in writing order (`Out`s, or `NativeOut`s of a native view)."""

    file: str
    tensors: tuple


def family_for(view: ModelView) -> MoEFamily:
    """The family record of a view: the HF source's, or for a Megatron view the first in the
    registry whose Megatron mapping claims it, else the registry's default mapping."""
    from mcore_proxy.checkpoint.hf.families import family_named, with_megatron

    source = hf_source(view)
    if source is not None:
        return family_named(source.family)
    mapped = with_megatron()
    claimed = next((f for f in mapped if f.megatron.claims is not None and f.megatron.claims(view)), None)
    return claimed or next(f for f in mapped if f.megatron.default)


def _row_for(family: MoEFamily, name: str) -> tuple[Row, str, int | None, int | None]:
    scope, index, rest, row_scope = split_canonical(name)
    found = family.megatron_table().match_canonical(row_scope, rest)
    if found is None:
        raise CheckpointError(
            f"tensor {name} has no {family.name} Hugging Face name; this model has a part that "
            f"the transformers {family.name} model lacks, so it cannot be written as one; keep it "
            "in a Megatron format (--format legacy or torch_dist)"
        )
    return found[0], scope, index, found[1]


def _piece_shapes(row: Row, shape: tuple[int, ...], view: ModelView, family: MoEFamily):
    if row.transform == GLU:
        return [(shape[0] // 2,) + shape[1:]] * 2
    if row.transform == QKV:
        heads, groups, head_dim = family.megatron.qkv_groups(view.args)
        return [(heads * head_dim,) + shape[1:], (groups * head_dim,) + shape[1:], (groups * head_dim,) + shape[1:]]
    return [shape]


def outputs_of(view: ModelView, family: MoEFamily, name: str) -> list[Out]:
    """The HF tensors canonical `name` becomes."""
    scale = name.endswith(SCALE_SUFFIX)
    row, scope, index, expert = _row_for(family, name[: -len(SCALE_SUFFIX)] if scale else name)
    if scale and row.transform not in ("copy", GLU):
        raise CheckpointError(
            f"{name}: FP8 block scales cannot follow a {row.transform} transform; convert with --dequantize"
        )
    shapes = _piece_shapes(row, tuple(view.shape(name)), view, family)
    table = family.megatron_table()
    num_layers, mtp_prefix = view.spec.num_layers, table.mtp_prefix
    dtype = torch_dtype(row.dtypes[0]) if row.dtypes is not None else view.dtype(name)
    gather = ()
    if row.transform == PICK:  # the first element's row writes the HF tensor of all its siblings
        siblings = table.siblings(row)
        if row is not siblings[0]:
            return []
        gather = tuple(canonical_name(s, scope, index, None) for s in siblings[1:])
        shapes = [(len(siblings),) + tuple(shapes[0][1:])]
    return [
        Out(
            hf_name(pattern, scope, index, expert, num_layers, mtp_prefix) + (SCALE_SUFFIX if scale else ""),
            name,
            i,
            shape,
            dtype,
            gather,
        )
        for i, (pattern, shape) in enumerate(zip(row.hf, shapes))
    ]


def _tied_copies(view: ModelView, family: MoEFamily, depth: int, present: set[str]) -> list[Out]:
    """DeepSeek's MTP layers carry copies of the embedding and LM head (megatron shares them)."""
    out = []
    for ign in family.megatron_table().ignored:
        if ign.scope == MTP and ign.tied_to and ign.tied_to in present:
            out.append(
                Out(
                    f"model.layers.{view.spec.num_layers + depth}.{ign.hf}",
                    ign.tied_to,
                    0,
                    tuple(view.shape(ign.tied_to)),
                    view.dtype(ign.tied_to),
                )
            )
    return out


def output_groups(view: ModelView, family: MoEFamily) -> list[list[Out]]:
    """Every output tensor, grouped by the canonical tensor it is cut from, in canonical order."""
    names = view.names()
    present = set(names)
    groups, last_mtp = [], None
    for name in names:
        scope, index, _, _ = split_canonical(name)
        if last_mtp is not None and (scope, index) != (MTP, last_mtp):
            groups.append(_tied_copies(view, family, last_mtp, present))
        last_mtp = index if scope == MTP else None
        groups.append(outputs_of(view, family, name))
    if last_mtp is not None:
        groups.append(_tied_copies(view, family, last_mtp, present))
    return [g for g in groups if g]


def plan_shards(groups: list[list[Out]], max_bytes: int) -> list[Shard]:
    """Fill shards in order; a group (pieces of one canonical tensor) never spans two shards."""
    shards: list[list[Out]] = [[]]
    size = 0
    for group in groups:
        nbytes = sum(o.nbytes for o in group)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nbytes
    n = len(shards)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(s)) for i, s in enumerate(shards)]


def _pieces(view: ModelView, family: MoEFamily, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The HF pieces of canonical tensor `name`: itself, [gate, up], [q, k, v], or its rows in HF's order."""
    row = _row_for(family, name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name)[0]
    if row.transform == GLU:
        return list(glu_split(tensor))
    if row.transform == QKV:
        heads, groups, head_dim = family.megatron.qkv_groups(view.args)
        return list(qkv_split(tensor, heads, groups, head_dim))
    if row.transform == ROPE_LAST:
        return [rope_last(tensor, family.megatron.rope_layout(view.args), inverse=True)]
    return [tensor]


class HFWriter(Writer):
    """The HF format's Writer (`checkpoint/interface.py`): no parallel layout (`target` is None),
    units are shards, `finish` writes config.json, the generation config and the tokenizer and
    returns the index as the marker."""

    def __init__(self, max_shard_bytes: int | None = None):
        self.max_shard_bytes = max_shard_bytes

    def target(self, view: ModelView, options: TargetOptions) -> None:
        """HF output has no parallel layout: the options that set one are refused."""
        self.refuse_options(options)
        given = [_FLAGS[name] for name in options.given()]
        if given:
            raise ProxyError(
                f"{', '.join(given)} set a Megatron layout, but a Hugging Face checkpoint is not sharded "
                "by parallel rank (transformers and vLLM shard it at load); leave them out or choose "
                "--format legacy or torch_dist"
            )
        return None

    def check(self, view: ModelView, target=None) -> None:
        """Everything that can fail before a byte is written: a family for every tensor, a
        config.json for the view, routing groups that transformers can run."""
        from mcore_proxy.checkpoint.target import refuse_noop_layers

        refuse_noop_layers(view, "Hugging Face")
        if native_source(view) is not None:
            native_outputs(view)
        else:
            family = family_for(view)
            output_groups(view, family)
        self.config(view)
        spec = view.spec
        if spec.num_groups and spec.num_groups > 1 and spec.num_experts // spec.num_groups < 2:
            raise ProxyError(
                f"{spec.num_experts} experts in {spec.num_groups} routing groups leave "
                f"{spec.num_experts // spec.num_groups} per group, but transformers scores a group by its "
                "2 best experts; keep at least 2 per group or flatten the groups (--group-policy flatten)"
            )

    def shard_bytes(self, view: ModelView) -> int:
        if self.max_shard_bytes:
            return self.max_shard_bytes
        source = hf_source(view) or native_source(view)
        if source is None:
            return DEFAULT_SHARD_BYTES
        sizes = [p.stat().st_size for p in Path(source.folder).glob("*.safetensors")]
        return max(sizes) if sizes else DEFAULT_SHARD_BYTES

    def shards(self, view: ModelView) -> list[Shard]:
        if native_source(view) is not None:
            groups = [[out] for out in native_outputs(view)]
        else:
            groups = output_groups(view, family_for(view))
        return plan_shards(groups, self.shard_bytes(view))

    def units(self, view: ModelView, target=None) -> list[Unit]:
        return [Unit((i,), sum(o.nbytes for o in shard.tensors)) for i, shard in enumerate(self.shards(view))]

    def write_unit(self, view: ModelView, root: Path, target, unit: Unit, progress=None) -> list[WrittenFile]:
        """Stream one shard: each canonical tensor read once (the next ones read ahead), cut into
        its HF pieces (Megatron-named views) or, for a fused tensor of a native view, its rows
        written one after another; hashed while written, synced before returning."""
        shard = self.shards(view)[unit.key[0]]
        writer = StreamingWriter(Path(root) / shard.file, [(o.key, o.shape, o.dtype) for o in shard.tensors])
        try:
            if native_source(view) is not None:
                _write_native(view, writer, shard, progress)
            else:
                _write_megatron_named(view, family_for(view), writer, shard, progress)
            size, digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        return [WrittenFile(shard.file, size, digest)]

    def config(self, view: ModelView) -> dict:
        native = native_source(view)
        if native is not None:
            return native_proxy_config(native.config, view.spec, native.descriptor)
        family = family_for(view)
        source = hf_source(view)
        if source is None:  # expert count, top-k and groups in the family's spellings, as below
            return native_proxy_config(
                family.megatron.config_from_args(_tying_said(view), view.spec), view.spec, family
            )
        config = native_proxy_config(source.config, view.spec, family)  # drops auto_map: no remote code
        if "quantization_config" in config and not source.fp8_block:
            del config["quantization_config"]
            config["dtype"] = "bfloat16"
        return config

    def finish(self, view: ModelView, root: Path, target, results) -> Finished:
        """Write config.json, the generation config and the tokenizer; return the index (the
        completeness marker) for the caller to write last."""
        root = Path(root)
        files = [
            _write_small(root, "config.json", (json.dumps(self.config(view), indent=2, sort_keys=True) + "\n").encode())
        ]
        source = hf_source(view) or native_source(view)
        if source is not None:
            for name in CONFIG_FILES + TOKENIZER_FILES:
                src = Path(source.folder) / name
                if src.is_file():
                    files.append(_write_small(root, name, src.read_bytes()))
        shards = self.shards(view)
        index = {
            "metadata": {"total_size": sum(o.nbytes for s in shards for o in s.tensors)},
            "weight_map": {o.key: s.file for s in shards for o in s.tensors},
        }
        return Finished(tuple(files), {INDEX: (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()})


def _tying_said(view: ModelView) -> argparse.Namespace:
    """The view's args with `untie_embeddings_and_output_weights` as the checkpoint has it
    (`names.embeddings_tied`: args without the field, like the quickstart's, hold an output layer
    of their own beside them), so config.json's `tie_word_embeddings` matches the tensors written."""
    args = copy.copy(view.args)
    args.untie_embeddings_and_output_weights = not embeddings_tied(view.args, OUTPUT_LAYER in view.names())
    return args


# TargetOptions fields -> the convert flags that set them (for the refusal above)
_FLAGS = {
    "tp": "--target-tp",
    "pp": "--target-pp",
    "ep": "--target-ep",
    "etp": "--target-etp",
    "expert_layout": "--expert-layout",
    "stage_layers": "--target-stage-layers",
    "pipeline_layout": "--target-pipeline-layout",
    "vpp": "--target-vpp",
    "tp_extend_ep": "--moe-tp-extend-ep",
}


def _write_megatron_named(view: ModelView, family: MoEFamily, writer: StreamingWriter, shard: Shard, progress) -> None:
    import torch

    firsts = [i for i, o in enumerate(shard.tensors) if o.piece == 0]
    for i, (_, tensor) in zip(firsts, stream(view, [shard.tensors[i].source for i in firsts])):
        count = _count(shard.tensors, i)
        if shard.tensors[i].gather:  # a pick row's HF tensor: its elements from their canonical tensors
            tensor = torch.cat([tensor] + [view.get(n) for n in shard.tensors[i].gather])
        for out, piece in zip(shard.tensors[i : i + count], _pieces(view, family, shard.tensors[i].source, tensor)):
            writer.write(out.key, piece.to(out.dtype))
        if progress is not None:
            progress(tensor.numel() * tensor.element_size())
        del tensor


def _write_native(view: ModelView, writer: StreamingWriter, shard: Shard, progress) -> None:
    """Each output (`native_writer.NativeOut`) from its canonical sources: several are a fused tensor's rows."""
    tensors = stream(view, [name for out in shard.tensors for name in out.sources])
    for out in shard.tensors:
        rows = [next(tensors)[1] for _ in out.sources]
        writer.write_rows(out.key, rows) if len(rows) > 1 else writer.write(out.key, rows[0])
        if progress is not None:
            progress(sum(r.numel() * r.element_size() for r in rows))
        del rows


def _write_small(root: Path, name: str, data: bytes) -> WrittenFile:
    """A small file, hashed while written and synced."""
    with HashingSink(root / name) as sink:
        sink.write(data)
        size, digest = sink.close()
    return WrittenFile(name, size, digest)


def _count(tensors: tuple[Out, ...], i: int) -> int:
    """Pieces of one canonical tensor sit together: the run of outputs sharing its source."""
    n = 1
    while i + n < len(tensors) and tensors[i + n].source == tensors[i].source and tensors[i + n].piece == n:
        n += 1
    return n
