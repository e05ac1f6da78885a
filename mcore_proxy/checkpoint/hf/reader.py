"""Reader: a Hugging Face folder (config.json + sharded safetensors) as a lazy canonical ModelView.

Opening reads `config.json`, the shard index and every shard's header (shapes and dtypes, no
tensor data) (or takes them from the native view that read them: a folder is indexed once), maps
every key through the family record's Megatron table (`MoEFamily.megatron_table`), and checks
that config.json and the tensors agree. `get(name)` reads only that tensor's bytes (its HF
parts, or one expert's rows of a fused tensor). The folder's Python files, `auto_map` and
pickles are never used: weights come from safetensors only, and a `pytorch_model*.bin` folder
is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.hf import quant
from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.descriptor import MoEFamily
from mcore_proxy.checkpoint.hf.families import family_of
from mcore_proxy.checkpoint.hf.folder import read_headers, weight_map
from mcore_proxy.checkpoint.hf.mapping import (
    COPY,
    FUSED,
    GLU,
    LAYER,
    MODEL,
    MTP,
    PICK,
    QKV,
    ROPE_LAST,
    SCALE_SUFFIX,
    Row,
    canonical_name,
    glu_join,
    joined_shape,
    qkv_join,
    rope_last,
    split_hf_key,
)
from mcore_proxy.checkpoint.hf.safetensors_io import TensorInfo, read_tensor
from mcore_proxy.checkpoint.names import canonical_sort_key
from mcore_proxy.checkpoint.view import ModelView, ViewInfo
from mcore_proxy.core.dtypes import torch_dtype
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.spec import ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def require_mapping(family: MoEFamily, config: HFConfig):
    """The family's Megatron mapping, if it covers config.json's architecture; else one sentence."""
    arch = config.architecture()
    if family.megatron is None or arch not in family.megatron.architectures:
        raise ProxyError(
            f"{config.path}: {arch} ({family.name}) has no Megatron mapping in mcore-proxy; convert "
            "it to --format hf (Hugging Face to Hugging Face needs none); docs/families.md lists "
            "the families that have one"
        )
    return family.megatron


@dataclass(frozen=True)
class HFSource:
    """What an HF-derived view carries for an HF writer: the source folder (tokenizer and
    generation config), its config.json, its family and whether it is stored as FP8 blocks."""

    folder: Path
    config: dict
    family: str
    fp8_block: tuple[int, int] | None = None  # weight_block_size of an FP8 checkpoint


@dataclass(frozen=True)
class _Part:
    file: str
    key: str
    info: TensorInfo
    index: int | None = None  # row of a fused tensor
    scale: "_Part | None" = None  # the FP8 block scales of this part


@dataclass
class _Entry:
    row: Row
    parts: dict[int, _Part]


class HFCheckpoint(ModelView):
    """A Hugging Face checkpoint folder under canonical names (DESIGN.md 4.3).

    `args` are the Megatron args of the same model (from config.json), `spec` is built from
    them, `iteration` is "release" (what HF -> Megatron converters write), `layout` None.
    With `dequantize_fp8`, FP8 weights read as bf16 and their scales are not part of the view.
    """

    def __init__(self, path, dequantize_fp8: bool = False, *, family: MoEFamily | None = None, index=None):
        """index: (HFConfig, weight map, headers) already read from this folder, else read here;
        family: the folder's record (`families.family_of` when not given)."""
        self.path = Path(path)
        if index is None:
            config = HFConfig.load(self.path)
            wmap = weight_map(self.path)
            index = (config, wmap, read_headers(self.path, wmap))
        self._read_index = index
        self.config, wmap, infos = index
        self.family = family or family_of(self.config)
        self.mapping = require_mapping(self.family, self.config)
        self.table = self.family.megatron_table()
        self.dequantize_fp8 = dequantize_fp8
        self.num_layers = self.config.layer_count()
        self._entries: dict[str, _Entry] = {}
        self._fp8_block = self._block_size(infos)
        self._index(wmap, infos)
        self._check_complete()
        self.mtp_layers = self._mtp_depths()
        args = self.mapping.args_from_config(self.config, self.mtp_layers)
        spec = ModelSpec.from_args(args, str(self.config.path))
        spec = dataclasses.replace(spec, extra={**spec.extra, "hf_family": self.family.name})
        self.hf = HFSource(
            self.path, dict(self.config.data), self.family.name, None if dequantize_fp8 else self._fp8_block
        )
        super().__init__(
            ViewInfo(
                spec=spec,
                format="hf",
                path=self.path,
                iteration="release",
                args=args,
                layout=None,
                format_info=self.hf,
                variants=self.mapping.variants,
            )
        )
        from mcore_proxy.checkpoint.hf.checks import check_config_matches

        check_config_matches(self)

    # -- indexing ---------------------------------------------------------------------------
    def _block_size(self, infos: dict[str, TensorInfo]) -> tuple[int, int] | None:
        if not any(k.endswith(SCALE_SUFFIX) for k in infos):
            return None
        config = self.config.dict("quantization_config", {})
        block = config.get("weight_block_size", list(quant.DEFAULT_BLOCK))
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(
                f"{self.config.path}: quantization_config.weight_block_size is {block!r}, expected "
                "two positive integers; fix config.json"
            )
        return tuple(block)

    def _index(self, wmap: dict[str, str], infos: dict[str, TensorInfo]) -> None:
        table = self.table
        scales = {k for k in wmap if k.endswith(SCALE_SUFFIX)}
        for key in sorted(set(wmap) - scales):
            scope, index, rest = split_hf_key(key, self.num_layers)
            found = table.match_hf(scope, rest)
            if found is None:
                ignored = table.ignored_for(scope, rest)
                if ignored is None:
                    raise CheckpointError(
                        f"{self.path / wmap[key]}: tensor {key} matches no {self.family.name} name "
                        "that mcore-proxy maps; it is not dropped silently: this checkpoint is not "
                        f"a plain {self.family.name} (check its architecture in config.json)"
                    )
                log.info("%s: %s not read (%s)", self.path.name, key, ignored.why)
                continue
            row, part, expert = found
            scale_key = key + SCALE_SUFFIX
            scale = _Part(wmap[scale_key], scale_key, infos[scale_key]) if scale_key in scales else None
            if scale is not None:
                self._check_scaled(key, wmap[key], infos[key], row)
            if row.transform == FUSED:
                for e in range(infos[key].shape[0]):
                    info = TensorInfo(infos[key].shape[1:], infos[key].dtype)
                    self._add(canonical_name(row, scope, index, e), row, 0, _Part(wmap[key], key, info, e), key)
            else:
                for each in table.siblings(row):  # a pick row's HF tensor holds several canonical ones
                    self._add(
                        canonical_name(each, scope, index, expert),
                        each,
                        part,
                        _Part(wmap[key], key, infos[key], scale=scale),
                        key,
                    )
        orphans = sorted(s for s in scales if s[: -len(SCALE_SUFFIX)] not in wmap)
        if orphans:
            raise CheckpointError(
                f"{self.path / wmap[orphans[0]]}: {orphans[0]} scales a tensor the checkpoint does "
                "not hold; the shards are incomplete, copy them again"
            )

    def _check_scaled(self, key: str, file: str, info: TensorInfo, row: Row) -> None:
        """Block scales are copied with their tensor where the row keeps blocks whole (copy,
        glu); q/k/v interleaving would cut them, so those are read dequantised only."""
        if info.dtype != quant.FP8 or row.transform == FUSED:
            raise CheckpointError(
                f"{self.path / file}: {key} has block scales but is {info.dtype}"
                f"{' (fused experts)' if row.transform == FUSED else ''}; only per-tensor "
                "float8_e4m3fn weights with *_scale_inv are supported"
            )
        if row.transform in (QKV, ROPE_LAST) and not self.dequantize_fp8:
            raise CheckpointError(
                f"{self.path / file}: {key} is FP8 with block scales, which cannot follow the "
                f"{'per-group q/k/v interleave' if row.transform == QKV else 'reordering of its rotated dims'}; "
                "pass --dequantize-fp8 to read it as bf16"
            )

    def _add(self, name: str, row: Row, part: int, piece: _Part, key: str) -> None:
        entry = self._entries.setdefault(name, _Entry(row, {}))
        if part in entry.parts or entry.row.hf != row.hf:
            raise CheckpointError(
                f"{self.path / piece.file}: {key} names canonical tensor {name} a second time "
                "(per-expert and fused experts mixed?); the checkpoint is inconsistent"
            )
        entry.parts[part] = piece

    def _check_complete(self) -> None:
        for name, entry in self._entries.items():
            missing = [p for i, p in enumerate(entry.row.hf) if i not in entry.parts]
            if missing:
                raise CheckpointError(
                    f"{self.path}: {name} needs {', '.join(missing)} too, which no shard holds; "
                    "the checkpoint is incomplete, copy it again"
                )
            joined_shape(entry.row.transform, [p.info.shape for p in entry.parts.values()])
            elements = len(self.table.siblings(entry.row))
            if entry.row.transform == PICK and tuple(entry.parts[0].info.shape) != (elements,):
                raise CheckpointError(
                    f"{self.path}: {entry.parts[0].key} has shape {list(entry.parts[0].info.shape)}, "
                    f"expected [{elements}]; the checkpoint is not a plain {self.family.name}"
                )
            if len({p.info.dtype for p in entry.parts.values()}) != 1:
                raise CheckpointError(
                    f"{self.path}: the parts of {name} have different dtypes; the checkpoint is inconsistent"
                )

    def _mtp_depths(self) -> int:
        depths = sorted({int(n.split(".")[2]) for n in self._entries if n.startswith("mtp.layers.")})
        declared = self.config.int("num_nextn_predict_layers", 0)
        if depths and (depths != list(range(len(depths))) or len(depths) > declared):
            raise CheckpointError(
                f"{self.config.path}: num_hidden_layers={self.num_layers} and "
                f"num_nextn_predict_layers={declared}, but the shards hold layers "
                f"{[self.num_layers + d for d in depths]} past the decoder; fix config.json"
            )
        if declared > len(depths):
            log.info(
                "%s: config.json declares %d MTP layers, the shards hold %d (transformers' save_pretrained "
                "writes none)",
                self.path,
                declared,
                len(depths),
            )
        return len(depths)

    # -- the ModelView ------------------------------------------------------------------------
    def names(self) -> list[str]:
        names = list(self._entries)
        if self.hf.fp8_block:
            names += [n + SCALE_SUFFIX for n, e in self._entries.items() if e.parts[0].scale is not None]
        return sorted(names, key=canonical_sort_key)

    def _entry(self, name: str) -> tuple[_Entry, bool]:
        if name.endswith(SCALE_SUFFIX) and self.hf.fp8_block and name[: -len(SCALE_SUFFIX)] in self._entries:
            return self._entries[name[: -len(SCALE_SUFFIX)]], True
        try:
            return self._entries[name], False
        except KeyError:
            raise KeyError(name) from None

    def _parts(self, name: str) -> tuple[Row, list[_Part]]:
        entry, scale = self._entry(name)
        parts = [entry.parts[i] for i in range(len(entry.row.hf))]
        return entry.row, [p.scale for p in parts] if scale else parts

    def _read(self, part: _Part) -> torch.Tensor:
        tensor = read_tensor(self.path / part.file, part.key, part.index)
        if self.dequantize_fp8 and part.scale is not None:
            scale = read_tensor(self.path / part.scale.file, part.scale.key)
            tensor = quant.dequantize_blocks(tensor, scale, self._fp8_block, f"{self.path / part.file}: {part.key}")
        return tensor

    def get(self, name: str) -> torch.Tensor:
        row, parts = self._parts(name)
        tensors = [self._read(p) for p in parts]
        if row.dtypes is not None:
            tensors = [t.to(torch_dtype(row.dtypes[1])) for t in tensors]
        if row.transform == GLU:
            return glu_join(*tensors)
        if row.transform == QKV:
            return qkv_join(*tensors, groups=self.mapping.qkv_groups(self.args)[1])
        if row.transform == PICK:
            return tensors[0][row.index : row.index + 1].clone()
        if row.transform == ROPE_LAST:
            return rope_last(tensors[0], self.mapping.rope_layout(self.args))
        return tensors[0]

    def shape(self, name: str) -> tuple[int, ...]:
        row, parts = self._parts(name)
        return joined_shape(COPY if row.transform == FUSED else row.transform, [p.info.shape for p in parts])

    def dtype(self, name: str) -> torch.dtype:
        import torch

        row, parts = self._parts(name)
        dtype = parts[0].info.dtype
        if row.dtypes is not None:
            return torch_dtype(row.dtypes[1])
        return torch.bfloat16 if self.dequantize_fp8 and dtype == quant.FP8 else dtype

    def dequantized(self) -> "HFCheckpoint":
        if self.hf.fp8_block is None:
            return super().dequantized()
        return HFCheckpoint(self.path, dequantize_fp8=True, family=self.family, index=self._read_index)


def hf_source(view) -> HFSource | None:
    """The HFSource a view carries (an HF folder, or a view derived from one), else None."""
    info = view.info.format_info
    return info if isinstance(info, HFSource) else None


__all__ = ["HFCheckpoint", "HFSource", "hf_source", "require_mapping", "LAYER", "MODEL", "MTP"]
