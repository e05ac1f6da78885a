"""Megatron legacy (`torch`) checkpoints, read: `iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`.

Opening parses each rank file's pickle once (no tensor bytes), builds an index from canonical
names to the shards that hold them, and reads a tensor's bytes only when `get` asks for it.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.checkpoint.iteration import TRACKER, is_iteration_folder_name, resolve_iteration_dir
from mcore_proxy.checkpoint.layer_spec import infer_layer_spec
from mcore_proxy.checkpoint.layout import ParallelLayout, layout_from_args, rank_dir_name
from mcore_proxy.checkpoint.names import (OUTPUT_LAYER, SEQUENTIAL, TE_GROUPED, WORD_EMBEDDINGS, LocalKey,
                                          canonical_sort_key, embeddings_tied, layer_number, parse_local_key,
                                          te_grouped_extra_state)
from mcore_proxy.checkpoint.te_extra_state import empty_extra_state, holds_state
from mcore_proxy.checkpoint.torchfile import LazyTensor, TorchFile
from mcore_proxy.checkpoint.view import ModelView, ViewInfo
from mcore_proxy.errors import CheckpointError
from mcore_proxy.sharding import REPLICATED, is_ignored, rule_for
from mcore_proxy.spec import ModelSpec, layer_module_prefix

log = logging.getLogger(__name__)

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def _rank_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and _RANK_DIR.match(p.name))


def is_legacy_checkpoint(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / TRACKER).is_file() or bool(_rank_dirs(path))
                              or any(is_iteration_folder_name(p.name) for p in path.iterdir()))


def resolve_legacy_dir(path) -> tuple[Path, int | str]:
    """Checkpoint root or iteration folder -> (iteration folder, iteration); an iteration folder
    holds mp_rank_* folders."""
    return resolve_iteration_dir(path, lambda folder: bool(_rank_dirs(folder)),
                                 f"not a Megatron checkpoint (no {TRACKER}, iter_* or mp_rank_* folders); pass "
                                 "the folder Megatron saved with --save")


class _GroupedExpert:
    """One expert's fc1/fc2 inside a GroupedMLP `weight1` [H, El*n] / `weight2` [El*m, H].

    Megatron views weight1 as (El, H, n) and weight2 as (El, m, H): expert j's bytes are one
    contiguous run, so only they are read. Canonical shards: fc1 [n, H], fc2 [H, m].
    """

    def __init__(self, lazy: LazyTensor, fc: int, j: int, local_experts: int):
        self.lazy, self.fc, self.j, self.el = lazy, fc, j, local_experts
        rows, cols = lazy.shape
        if (cols if fc == 1 else rows) % local_experts:
            raise CheckpointError(f"{lazy.file.path}: GroupedMLP weight{fc} shape {tuple(lazy.shape)} "
                                  f"does not divide into {local_experts} experts")
        self.shape = (cols // local_experts, rows) if fc == 1 else (cols, rows // local_experts)
        self.dtype = lazy.dtype

    def byte_ranges(self) -> list[tuple[Path, int, int]]:
        per = self.lazy.shape.numel() // self.el
        return [(self.lazy.file.path, *self.lazy.byte_range(self.j * per, per))]

    def will_need(self) -> None:
        per = self.lazy.shape.numel() // self.el
        self.lazy.will_need(self.j * per, per)

    def load(self) -> torch.Tensor:
        per = self.lazy.shape.numel() // self.el
        flat = self.lazy.read_flat(self.j * per, per)
        return flat.view(self.shape[1], self.shape[0]).t().contiguous()


class _Constant:
    """A non-tensor entry (`_extra_state`), copied as is."""

    shape = None
    dtype = None

    def __init__(self, value):
        self.value = value

    def byte_ranges(self) -> list:
        return []

    def will_need(self) -> None:
        pass

    def load(self):
        return self.value


@dataclass
class _Entry:
    """One canonical tensor: its rule and its shards in (E)TP rank order."""

    rule: object
    parts: int
    shards: dict[int, object] = field(default_factory=dict)
    where: dict[int, Path] = field(default_factory=dict)


# -- the reader ------------------------------------------------------------------------------

def _parse_rank_dir(name: str, layout: ParallelLayout) -> tuple[int, int, int]:
    m = _RANK_DIR.match(name)
    suffixes = [int(g) for g in m.groups()[1:] if g is not None]
    expected = (layout.pp > 1) + (layout.ep > 1)
    if len(suffixes) != expected:
        raise CheckpointError(f"{name}: rank folder name does not fit {layout.describe()} from the "
                              "checkpoint's args; the folder comes from another run, remove it")
    pp = suffixes.pop(0) if layout.pp > 1 else 0
    ep = suffixes.pop(0) if layout.ep > 1 else 0
    return int(m.group(1)), pp, ep


def _check_rank_dirs(it_dir: Path, coords: dict[tuple[int, int, int], Path], layout: ParallelLayout) -> None:
    """Every folder a Megatron save of this layout writes must be there (and no stranger)."""
    for c, path in coords.items():
        if c[0] >= layout.tp or c[1] >= layout.pp or c[2] >= layout.ep:
            raise CheckpointError(f"{path}: rank folder outside {layout.describe()}; it comes from "
                                  "another run, remove it")
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            for ep in range(layout.ep):
                needed = layout.etp == layout.tp
                covered = (any((tp, pp, e) in coords for e in range(layout.ep))
                           and any((t, pp, ep) in coords for t in range(layout.tp)))
                if (tp, pp, ep) not in coords and (needed or not covered):
                    missing = it_dir / rank_dir_name(tp, pp, ep, layout)
                    raise CheckpointError(f"{missing}: rank folder missing for {layout.describe()}; "
                                          "copy it from the source checkpoint")


class LegacyCheckpoint(ModelView):
    """A Megatron legacy checkpoint as a canonical ModelView."""

    def __init__(self, path: str | Path):
        self.path, iteration = resolve_legacy_dir(path)
        dirs = _rank_dirs(self.path)
        if not dirs:
            raise CheckpointError(f"{self.path}: no mp_rank_* folders; the iteration folder is empty "
                                  "or incomplete, copy it again from the source")
        first = self._open(dirs[0])
        args = first.obj.get("args")
        if args is None:
            raise CheckpointError(f"{first.path}: no 'args' entry; mcore-proxy needs the args Megatron "
                                  "saves (was the checkpoint written with --no-save-args?)")
        self._spec = ModelSpec.from_args(args, where=str(first.path))
        layout = layout_from_args(args, dirs[0])
        coords = {_parse_rank_dir(d.name, layout): d for d in dirs}
        _check_rank_dirs(self.path, coords, layout)
        if layout.etp not in (1, layout.tp):
            raise CheckpointError(f"{self.path}: expert tensor parallel size {layout.etp} differs from "
                                  f"both 1 and TP={layout.tp}; such folders do not say which expert shard "
                                  "they hold, re-save with ETP=1 or ETP=TP")
        self.files = {c: (first if d == dirs[0] else self._open(d)) for c, d in coords.items()}
        self._layer_spec = infer_layer_spec(args, self._local_shapes(layout), layout.tp, str(first.path))
        self._entries: dict[str, _Entry] = {}
        self._expert_layout = SEQUENTIAL
        self._variants: set[str] = set()
        self._linear_extra_state = False
        self._reset_states = 0
        for c in sorted(self.files):
            self._index_file(c, self.files[c], layout)
        if self._reset_states:
            log.warning("%s: %d TEGroupedMLP extra states hold FP8 metadata for all local experts; they are "
                        "reset to TE's empty state (never unpickled, see checkpoint/te_extra_state.py)",
                        self.path, self._reset_states)
        self._check_complete()
        self._drop_tied_output_copy(args)
        self._names = sorted(self._entries, key=canonical_sort_key)
        super().__init__(ViewInfo(
            spec=self._spec, format="legacy", path=self.path, iteration=iteration, args=args,
            checkpoint_version=first.obj.get("checkpoint_version"),
            layout=dataclasses.replace(layout, expert_layout=self._expert_layout),
            variants=frozenset(self._variants), linear_extra_state=self._linear_extra_state,
            layer_spec=self._layer_spec))

    @staticmethod
    def _open(rank_dir: Path) -> TorchFile:
        f = rank_dir / RANK_FILE
        if not f.is_file():
            raise CheckpointError(f"{f}: rank file missing; copy it from the source checkpoint")
        return TorchFile(f)

    def _model_chunks(self, tf: TorchFile, layout: ParallelLayout) -> list[dict]:
        obj = tf.obj
        if layout.vpp > 1:
            chunks = [obj.get(f"model{v}") for v in range(layout.vpp)]
        else:
            chunks = [obj.get("model")]
        if any(not isinstance(c, dict) for c in chunks):
            raise CheckpointError(f"{tf.path}: no model state ('model' or 'model0'..) for "
                                  f"{layout.describe()}; the file is not a Megatron model checkpoint")
        return chunks

    def _local_shapes(self, layout: ParallelLayout) -> dict[str, tuple[int, ...] | None]:
        """Rank-local key -> shape over every file (pickle metadata only: no tensor bytes)."""
        out = {}
        for tf in self.files.values():
            for chunk in self._model_chunks(tf, layout):
                for key, value in chunk.items():
                    out.setdefault(key, tuple(value.shape) if isinstance(value, LazyTensor) else None)
        return out

    def _index_file(self, coords, tf: TorchFile, layout: ParallelLayout) -> None:
        tp, pp, ep = coords
        offsets = layout.chunk_offsets()
        num_experts = self._spec.num_experts
        local_experts = num_experts // layout.ep if num_experts else 0
        for v, chunk in enumerate(self._model_chunks(tf, layout)):
            offset, count = offsets[(pp, v)]
            for key, value in chunk.items():
                if is_ignored(key):
                    continue
                lk = parse_local_key(key, offset, ep * local_experts)
                self._check_layer_range(key, lk, offset, count, tf)
                for name, piece in self._pieces(lk, value, local_experts, ep, tf):
                    rule = rule_for(name, self._layer_spec)
                    self._add(name, rule, rule.parts(layout), rule.shard_index(layout, tp), piece, tf.path)

    def _check_layer_range(self, key: str, lk: LocalKey, offset: int, count: int, tf: TorchFile) -> None:
        layer = layer_number(lk.canonical)
        if layer is not None and not offset <= layer < offset + count:
            raise CheckpointError(f"{tf.path}: key {key} lies outside this stage's {count} layers; the "
                                  "args' pipeline split does not match the files")

    def _pieces(self, lk: LocalKey, value, local_experts: int, ep: int, tf: TorchFile):
        """(canonical name, shard piece) pairs one local key contributes."""
        if lk.expert_layout:
            self._expert_layout = lk.expert_layout
        if lk.variant:
            self._variants.add(lk.variant)
        grouped_extra = te_grouped_extra_state(lk.canonical) if lk.kind == "plain" else None
        if grouped_extra is not None:
            # one opaque state for every local expert: reset per expert (te_extra_state.py)
            self._expert_layout = TE_GROUPED
            self._reset_states += holds_state(value)
            prefix, module = grouped_extra
            for j in range(local_experts):
                yield f"{prefix}.{ep * local_experts + j}.{module}._extra_state", _Constant(empty_extra_state())
            return
        if lk.kind == "grouped":
            if not isinstance(value, LazyTensor) or len(value.shape) != 2:
                raise CheckpointError(f"{tf.path}: {lk.canonical}.weight{lk.fc} is not a 2-D tensor")
            for j in range(local_experts):
                name = f"{lk.canonical}.{ep * local_experts + j}.linear_fc{lk.fc}.weight"
                yield name, _GroupedExpert(value, lk.fc, j, local_experts)
            return
        if value is None and lk.canonical.endswith("._extra_state"):
            # local linears save `_extra_state: None`; writers re-create it for the target modules
            self._linear_extra_state = True
            return
        if lk.kind == "expert" and lk.local_expert >= local_experts:
            raise CheckpointError(f"{tf.path}: local expert {lk.local_expert} but args say "
                                  f"{self._spec.num_experts} experts over EP={self._spec.num_experts // local_experts}")
        yield lk.canonical, value if isinstance(value, LazyTensor) else _Constant(value)

    def _add(self, name, rule, parts, shard, piece, path) -> None:
        entry = self._entries.setdefault(name, _Entry(rule, parts))
        if shard in entry.shards:
            old = entry.shards[shard]
            if old.shape is not None and tuple(old.shape) != tuple(piece.shape):
                raise CheckpointError(
                    f"{path}: {name} has shape {list(piece.shape)} but {entry.where[shard]} has "
                    f"{list(old.shape)}; the rank folders come from different runs, re-copy them")
            return
        for other, old in entry.shards.items():
            if old.shape is not None and tuple(old.shape) != tuple(piece.shape):
                raise CheckpointError(
                    f"{path}: shard of {name} has shape {list(piece.shape)} but {entry.where[other]} has "
                    f"{list(old.shape)}; the rank folders come from different runs, re-copy them")
        entry.shards[shard] = piece
        entry.where[shard] = path

    def _check_complete(self) -> None:
        for name, entry in self._entries.items():
            missing = [r for r in range(entry.parts) if r not in entry.shards]
            if missing:
                raise CheckpointError(f"{self.path}: tensor {name} lacks shard(s) {missing}; a rank "
                                      "folder is missing or incomplete, copy it from the source")
        if self._spec.num_experts:
            for layer_id in self._spec.moe_layer_ids:
                prefix = f"{layer_module_prefix(layer_id)}.mlp.experts."
                found = {n[len(prefix):].split(".")[0] for n in self._entries if n.startswith(prefix)}
                if len(found) != self._spec.num_experts:
                    raise CheckpointError(
                        f"{self.path}: MoE layer {layer_id} holds {len(found)} experts but args say "
                        f"num_experts={self._spec.num_experts}; the checkpoint is incomplete")

    def _drop_tied_output_copy(self, args) -> None:
        """With tied embeddings and PP > 1 the last stage saves `output_layer.weight`, its copy of the
        word embeddings (megatron-core `LanguageModule.setup_embeddings_and_output_layer`): the same
        canonical tensor, so it is not a tensor of the view (writers re-create it where the target
        needs it)."""
        if OUTPUT_LAYER not in self._entries or not embeddings_tied(args, True):
            return
        where = self._entries[OUTPUT_LAYER].where[0]
        if WORD_EMBEDDINGS not in self._entries:
            raise CheckpointError(f"{where}: args say the output layer is tied to the word embeddings, but no rank "
                                  f"file holds {WORD_EMBEDDINGS}; copy the first stage's rank folders too")
        copy, original = self.shape(OUTPUT_LAYER), self.shape(WORD_EMBEDDINGS)
        if copy != original:
            raise CheckpointError(f"{where}: {OUTPUT_LAYER} {list(copy)} should be the tied copy of {WORD_EMBEDDINGS} "
                                  f"{list(original)}; the rank folders come from different runs, re-copy them")
        del self._entries[OUTPUT_LAYER]

    # -- ModelView ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str):
        entry = self._entries[name]
        if entry.rule.kind == REPLICATED or entry.parts == 1:
            return entry.shards[0].load()
        return entry.rule.join([entry.shards[r].load() for r in range(entry.parts)])

    def byte_ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """(rank file, offset, length) of every run of bytes `get(name)` reads."""
        out = []
        for piece in self._entries[name].shards.values():
            if isinstance(piece, LazyTensor):
                out.append((piece.file.path, *piece.byte_range()))
            else:
                out += piece.byte_ranges()
        return out

    def prefetch(self, names: list[str]) -> None:
        """Start reading the bytes of `names`' shards (only theirs: a dropped expert next to a
        kept one stays unread) while the caller works on the current tensor."""
        for name in names:
            for piece in self._entries[name].shards.values():
                piece.will_need()

    def shape(self, name: str):
        entry = self._entries[name]
        shape = entry.shards[0].shape
        return None if shape is None else entry.rule.full_shape(tuple(shape), entry.parts)

    def dtype(self, name: str):
        return self._entries[name].shards[0].dtype
