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

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.checkpoint.hf.family import Family
from mcore_proxy.checkpoint.hf.mapping import (GLU, MTP, QKV, SCALE_SUFFIX, Row, glu_split, hf_name, qkv_split,
                                               split_canonical)
from mcore_proxy.checkpoint.hf.reader import INDEX, HFSource, families
from mcore_proxy.checkpoint.hf.safetensors_io import StreamingWriter
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.errors import CheckpointError, ProxyError

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 10**9
CONFIG_FILES = ("generation_config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# config.json keys that point at code or at settings the output no longer has
DROPPED_CONFIG_KEYS = ("auto_map",)


@dataclass(frozen=True)
class Out:
    """One output tensor: HF `key`, read from canonical `source`, piece `piece` of its split."""

    key: str
    source: str
    piece: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Shard:
    """One output file and the tensors in it, in writing order."""

    file: str
    tensors: tuple[Out, ...]


def family_for(view: ModelView) -> Family:
    """The HF family of a view: the source's, or for Megatron views the one its args describe."""
    source: HFSource | None = getattr(view, "hf", None)
    by_name = {f.name: f for f in families()}
    if source is not None:
        return by_name[source.family]
    args = view.args
    if getattr(args, "multi_latent_attention", False):
        indexer = any(".core_attention.indexer." in n for n in view.names())
        return by_name["DeepSeek-V3.2" if indexer else "DeepSeek-V3"]
    return by_name["Qwen3-MoE"]


def _row_for(family: Family, name: str) -> tuple[Row, str, int | None, int | None]:
    scope, index, rest, row_scope = split_canonical(name)
    found = family.table.match_canonical(row_scope, rest)
    if found is None:
        raise CheckpointError(f"tensor {name} has no {family.name} Hugging Face name; this model has a part that "
                              f"the transformers {family.name} model lacks, so it cannot be written as one")
    return found[0], scope, index, found[1]


def _piece_shapes(row: Row, shape: tuple[int, ...], view: ModelView, family: Family):
    if row.transform == GLU:
        return [(shape[0] // 2,) + shape[1:]] * 2
    if row.transform == QKV:
        heads, groups, head_dim = family.qkv_groups(view.args)
        return [(heads * head_dim,) + shape[1:], (groups * head_dim,) + shape[1:], (groups * head_dim,) + shape[1:]]
    return [shape]


def outputs_of(view: ModelView, family: Family, name: str) -> list[Out]:
    """The HF tensors canonical `name` becomes."""
    scale = name.endswith(SCALE_SUFFIX)
    row, scope, index, expert = _row_for(family, name[:-len(SCALE_SUFFIX)] if scale else name)
    if scale and row.transform not in ("copy", GLU):
        raise CheckpointError(f"{name}: FP8 block scales cannot follow a {row.transform} transform; convert with "
                              "--dequantize-fp8")
    shapes = _piece_shapes(row, tuple(view.shape(name)), view, family)
    num_layers = view.spec.num_layers
    return [Out(hf_name(pattern, scope, index, expert, num_layers) + (SCALE_SUFFIX if scale else ""), name, i,
                shape, view.dtype(name)) for i, (pattern, shape) in enumerate(zip(row.hf, shapes))]


def _tied_copies(view: ModelView, family: Family, depth: int, present: set[str]) -> list[Out]:
    """DeepSeek's MTP layers carry copies of the embedding and LM head (megatron shares them)."""
    out = []
    for ign in family.table.ignored:
        if ign.scope == MTP and ign.tied_to and ign.tied_to in present:
            out.append(Out(f"model.layers.{view.spec.num_layers + depth}.{ign.hf}", ign.tied_to, 0,
                           tuple(view.shape(ign.tied_to)), view.dtype(ign.tied_to)))
    return out


def output_groups(view: ModelView, family: Family) -> list[list[Out]]:
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


def _pieces(view: ModelView, family: Family, tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The HF pieces of one canonical tensor: itself, [gate, up], or [q, k, v]."""
    if count == 1:
        return [tensor]
    if count == 2:
        return list(glu_split(tensor))
    heads, groups, head_dim = family.qkv_groups(view.args)
    return list(qkv_split(tensor, heads, groups, head_dim))


class HFWriter:
    """The HF format's writer: check, units, write_unit, finish (see the module docstring)."""

    def __init__(self, max_shard_bytes: int | None = None):
        self.max_shard_bytes = max_shard_bytes

    def check(self, view: ModelView) -> Family:
        """Everything that can fail before a byte is written: a family for every tensor, a
        config.json for the view, routing groups that transformers can run."""
        family = family_for(view)
        output_groups(view, family)
        self.config(view, family)
        spec = view.spec
        if spec.num_groups and spec.num_groups > 1 and spec.num_experts // spec.num_groups < 2:
            raise ProxyError(f"{spec.num_experts} experts in {spec.num_groups} routing groups leave "
                             f"{spec.num_experts // spec.num_groups} per group, but transformers scores a group by its "
                             "2 best experts; keep at least 2 per group or flatten the groups (--group-policy flatten)")
        return family

    def shard_bytes(self, view: ModelView) -> int:
        if self.max_shard_bytes:
            return self.max_shard_bytes
        source: HFSource | None = getattr(view, "hf", None)
        if source is None:
            return DEFAULT_SHARD_BYTES
        sizes = [p.stat().st_size for p in Path(source.folder).glob("*.safetensors")]
        return max(sizes) if sizes else DEFAULT_SHARD_BYTES

    def units(self, view: ModelView) -> list[Shard]:
        return plan_shards(output_groups(view, family_for(view)), self.shard_bytes(view))

    def write_unit(self, view: ModelView, root: Path, shard: Shard, progress=None) -> Path:
        """Stream one shard: each canonical tensor read once, cut into its HF pieces."""
        family = family_for(view)
        path = Path(root) / shard.file
        writer = StreamingWriter(path, [(o.key, o.shape, o.dtype) for o in shard.tensors])
        try:
            i = 0
            while i < len(shard.tensors):
                first, count = shard.tensors[i], _count(shard.tensors, i)
                tensor = view.get(first.source)
                for out, piece in zip(shard.tensors[i:i + count], _pieces(view, family, tensor, count)):
                    writer.write(out.key, piece)
                if progress is not None:
                    progress.update(tensor.numel() * tensor.element_size())
                del tensor
                i += count
        finally:
            writer.close()
        return path

    def config(self, view: ModelView, family: Family) -> dict:
        source: HFSource | None = getattr(view, "hf", None)
        if source is None:
            return family.config_from_args(view.args, view.spec)
        config = family.proxy_config(source.config, view.spec)
        for key in DROPPED_CONFIG_KEYS:
            if config.pop(key, None) is not None:
                log.info("config.json: %s dropped (the model is built into transformers; no remote code)", key)
        if "quantization_config" in config and not source.fp8_block:
            del config["quantization_config"]
            config["dtype"] = "bfloat16"
        return config

    def finish(self, view: ModelView, root: Path, shards: list[Shard]) -> dict[str, bytes]:
        """Write config.json, the generation config and the tokenizer; return the index (the
        completeness marker) for the caller to write last."""
        root = Path(root)
        config = self.config(view, family_for(view))
        (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        source: HFSource | None = getattr(view, "hf", None)
        if source is not None:
            for name in CONFIG_FILES + TOKENIZER_FILES:
                src = Path(source.folder) / name
                if src.is_file():
                    shutil.copyfile(src, root / name)
        index = {"metadata": {"total_size": sum(o.nbytes for s in shards for o in s.tensors)},
                 "weight_map": {o.key: s.file for s in shards for o in s.tensors}}
        return {INDEX: (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()}


def _count(tensors: tuple[Out, ...], i: int) -> int:
    """Pieces of one canonical tensor sit together: the run of outputs sharing its source."""
    n = 1
    while i + n < len(tensors) and tensors[i + n].source == tensors[i].source and tensors[i + n].piece == n:
        n += 1
    return n


# -- what convert calls (until the format interface of issue 9 takes these over) ------------------

def check_hf_request(view: ModelView, req) -> None:
    """HF output has no parallel layout: refuse the options that set one, then `HFWriter.check`."""
    given = [flag for flag, value in (("--target-tp", req.tp), ("--target-pp", req.pp), ("--target-ep", req.ep),
                                      ("--target-etp", req.etp), ("--expert-layout", req.expert_layout),
                                      ("--target-stage-layers", req.stage_layers)) if value is not None]
    if given:
        raise ProxyError(f"{', '.join(given)} set a Megatron layout, but a Hugging Face checkpoint is not sharded by "
                         "parallel rank (transformers and vLLM shard it at load); leave them out or choose "
                         "--format legacy or torch_dist")
    HFWriter().check(view)
    return None


def write_hf_into(view: ModelView, root: Path, progress=None) -> dict[str, bytes]:
    """Write every shard and the small files into `root`; return the index (written last)."""
    writer = HFWriter()
    shards = writer.units(view)
    for shard in shards:
        writer.write_unit(view, root, shard, progress)
    return writer.finish(view, root, shards)
