"""Megatron legacy (`torch`) checkpoints: `iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`.

Reading parses each rank file's pickle once (no tensor bytes), builds an index from canonical
names to the shards that hold them, and reads a tensor's bytes only when `get` asks for it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.checkpoint.layer_spec import infer_layer_spec
from mcore_proxy.checkpoint.layout import ParallelLayout, check_fits, rank_dir_name, stage_layer_counts
from mcore_proxy.checkpoint.names import LINEAR_WEIGHT, SEQUENTIAL, LocalKey, parse_local_key
from mcore_proxy.checkpoint.safe_globals import check_writable, writable_args
from mcore_proxy.checkpoint.torchfile import LazyTensor, TorchFile
from mcore_proxy.checkpoint.view import ModelView, tensor_nbytes
from mcore_proxy.errors import CheckpointError, ProxyError
from mcore_proxy.megatron_args import DEFAULTS, arg, arg_int
from mcore_proxy.sharding import COLUMN, GLU_COLUMN, REPLICATED, ROW, is_ignored, join, rule_for
from mcore_proxy.spec import ModelSpec, layer_module_prefix
from mcore_proxy.units import BYTES_PROGRESS

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


# -- locating the iteration folder ----------------------------------------------------------

def _rank_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and _RANK_DIR.match(p.name))


def is_legacy_checkpoint(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / TRACKER).is_file() or bool(_rank_dirs(path))
                              or any(_ITER_DIR.match(p.name) for p in path.iterdir()))


def read_tracker(tracker: Path) -> str:
    """The tracker's text (stripped); a file that is not short text is refused by name."""
    data = tracker.read_bytes()[:4096]
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: holds binary data, expected an iteration number or 'release'; "
                              "fix the file or pass the iter_* folder directly") from None


def resolve_iteration_dir(path: str | Path, holds_data=None,
                          not_found: str = "not a Megatron checkpoint (no latest_checkpointed_iteration.txt, "
                          "iter_* or mp_rank_* folders); pass the folder Megatron saved with --save",
                          ) -> tuple[Path, int | str]:
    """Checkpoint root (with tracker) or an iteration folder -> (iteration folder, iteration).

    holds_data(folder): whether `folder` is itself an iteration folder of this format (default:
    it has mp_rank_* folders); not_found: the message when nothing fits."""
    path = Path(path)
    holds_data = holds_data or (lambda folder: bool(_rank_dirs(folder)))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder; pass the folder Megatron saved "
                              "(the one holding latest_checkpointed_iteration.txt)")
    tracker = path / TRACKER
    if tracker.is_file():
        text = read_tracker(tracker)
        if text == "release":
            it_dir, iteration = path / "release", "release"
        elif text.isdigit():
            it_dir, iteration = path / f"iter_{int(text):07d}", int(text)
        else:
            raise CheckpointError(f"{tracker}: holds {text!r}, expected an iteration number or "
                                  "'release'; fix the file or pass the iter_* folder directly")
        if not it_dir.is_dir():
            raise CheckpointError(f"{tracker}: names iteration {text} but {it_dir.name}/ does not "
                                  "exist; fix the tracker or pass an existing iter_* folder")
        return it_dir, iteration
    if holds_data(path):
        m = _ITER_DIR.match(path.name)
        return path, int(m.group(1)) if m else ("release" if path.name == "release" else path.name)
    iters = sorted(p.name for p in path.iterdir() if _ITER_DIR.match(p.name) or p.name == "release")
    if iters:
        raise CheckpointError(f"{path}: has {', '.join(iters)} but no {TRACKER}; pass the iteration "
                              f"folder you mean directly (e.g. {path / iters[-1]})")
    raise CheckpointError(f"{path}: {not_found}")


# -- shards ----------------------------------------------------------------------------------

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

    def load(self):
        return self.value


@dataclass
class _Entry:
    """One canonical tensor: its rule and its shards in (E)TP rank order."""

    rule: object
    parts: int
    shards: dict[int, object] = field(default_factory=dict)
    where: dict[int, Path] = field(default_factory=dict)


def _full_shape(entry: _Entry) -> tuple[int, ...] | None:
    shard = entry.shards[0]
    if shard.shape is None:
        return None
    shape = list(shard.shape)
    if entry.rule.kind in (COLUMN, GLU_COLUMN):
        shape[0] *= entry.parts
    elif entry.rule.kind == ROW:
        shape[1] *= entry.parts
    return tuple(shape)


# -- the reader ------------------------------------------------------------------------------

def _layout_from_args(args, folder: Path) -> ParallelLayout:
    """The saving run's layout from its args (absent fields: Megatron's defaults)."""
    where = str(folder)
    size = lambda n: arg_int(args, n, where, minimum=1, maximum=1 << 20)  # noqa: E731
    tp, pp = size("tensor_model_parallel_size") or 1, size("pipeline_model_parallel_size") or 1
    ep = size("expert_model_parallel_size") or 1
    etp = size("expert_tensor_parallel_size") or tp
    num_layers = arg_int(args, "num_layers", where, minimum=1)
    vpp = 1
    if size("num_layers_per_virtual_pipeline_stage"):
        vpp = max(1, num_layers // (pp * size("num_layers_per_virtual_pipeline_stage")))
    elif size("virtual_pipeline_model_parallel_size"):
        vpp = size("virtual_pipeline_model_parallel_size")
    text = arg(args, "pipeline_model_parallel_layout", where)
    if text:
        return _layout_from_string(args, text, tp, pp, ep, etp, num_layers, where)
    layer_list = arg(args, "num_layer_list", where)
    if layer_list is not None and not isinstance(layer_list, (str, list, tuple)):
        raise CheckpointError(f"{folder}: args num_layer_list is a {type(layer_list).__name__}, expected "
                              "comma-separated stage sizes; fix the args")
    try:
        counts = stage_layer_counts(num_layers, pp, size("decoder_first_pipeline_num_layers"),
                                    size("decoder_last_pipeline_num_layers"), layer_list, where=where)
    except ProxyError:
        raise
    except (ValueError, TypeError):  # a num_layer_list entry that is not a number
        raise CheckpointError(f"{folder}: args num_layer_list {layer_list!r} is not comma-separated stage "
                              "sizes; fix the args") from None
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, stage_layers=counts)


def _layout_from_string(args, text, tp, pp, ep, etp, num_layers, where) -> ParallelLayout:
    """The layout of a run saved with `--pipeline-model-parallel-layout` (validated as
    megatron-core does); stage_layers are each pipeline rank's decoder layers over its chunks."""
    from mcore_proxy.pipeline_layout import parse_pipeline_layout

    if not isinstance(text, str):
        raise CheckpointError(f"{where}: args pipeline_model_parallel_layout is a {type(text).__name__}, "
                              "expected Megatron's layout string; fix the args")
    mtp = arg_int(args, "mtp_num_layers", where) or 0
    try:
        parsed = parse_pipeline_layout(text, pp, num_layers, mtp)
    except ProxyError as err:
        raise CheckpointError(f"{where}: {err}") from None
    counts = tuple(sum(len(s.decoder) for s in parsed.stages if s.pp == p) for p in range(pp))
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=parsed.vpp, stage_layers=counts,
                          pipeline_layout=text)


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

    format = "legacy"

    def __init__(self, path: str | Path):
        self.path, self.iteration = resolve_iteration_dir(path)
        dirs = _rank_dirs(self.path)
        if not dirs:
            raise CheckpointError(f"{self.path}: no mp_rank_* folders; the iteration folder is empty "
                                  "or incomplete, copy it again from the source")
        first = self._open(dirs[0])
        self.args = first.obj.get("args")
        if self.args is None:
            raise CheckpointError(f"{first.path}: no 'args' entry; mcore-proxy needs the args Megatron "
                                  "saves (was the checkpoint written with --no-save-args?)")
        self.checkpoint_version = first.obj.get("checkpoint_version")
        self.spec = ModelSpec.from_args(self.args, where=str(first.path))
        layout = _layout_from_args(self.args, dirs[0])
        coords = {_parse_rank_dir(d.name, layout): d for d in dirs}
        _check_rank_dirs(self.path, coords, layout)
        if layout.etp not in (1, layout.tp):
            raise CheckpointError(f"{self.path}: expert tensor parallel size {layout.etp} differs from "
                                  f"both 1 and TP={layout.tp}; such folders do not say which expert shard "
                                  "they hold, re-save with ETP=1 or ETP=TP")
        self.files = {c: (first if d == dirs[0] else self._open(d)) for c, d in coords.items()}
        self.layer_spec = infer_layer_spec(self.args, self._local_shapes(layout), layout.tp, str(first.path))
        self._entries: dict[str, _Entry] = {}
        self.expert_layout = SEQUENTIAL
        self.variants: set[str] = set()
        self.linear_extra_state = False
        for c in sorted(self.files):
            self._index_file(c, self.files[c], layout)
        self._check_complete()
        self.layout = dataclasses.replace(layout, expert_layout=self.expert_layout)
        self._names = sorted(self._entries, key=canonical_sort_key)

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
        num_experts = self.spec.num_experts
        local_experts = num_experts // layout.ep if num_experts else 0
        for v, chunk in enumerate(self._model_chunks(tf, layout)):
            offset, count = offsets[(pp, v)]
            for key, value in chunk.items():
                if is_ignored(key):
                    continue
                lk = parse_local_key(key, offset, ep * local_experts)
                self._check_layer_range(key, lk, offset, count, tf)
                for name, piece in self._pieces(lk, value, local_experts, ep, tf):
                    rule = rule_for(name, self.layer_spec)
                    parts = 1 if rule.kind == REPLICATED else (layout.etp if rule.group == "etp" else layout.tp)
                    shard = 0 if parts == 1 else (tp if rule.group == "tp" or layout.etp == layout.tp else 0)
                    self._add(name, rule, parts, shard, piece, tf.path)

    def _check_layer_range(self, key: str, lk: LocalKey, offset: int, count: int, tf: TorchFile) -> None:
        m = re.match(r"^decoder\.layers\.(\d+)\.", lk.canonical)
        if m and not offset <= int(m.group(1)) < offset + count:
            raise CheckpointError(f"{tf.path}: key {key} lies outside this stage's {count} layers; the "
                                  "args' pipeline split does not match the files")

    def _pieces(self, lk: LocalKey, value, local_experts: int, ep: int, tf: TorchFile):
        """(canonical name, shard piece) pairs one local key contributes."""
        if lk.expert_layout:
            self.expert_layout = lk.expert_layout
        if lk.variant:
            self.variants.add(lk.variant)
        if lk.kind == "grouped":
            if not isinstance(value, LazyTensor) or len(value.shape) != 2:
                raise CheckpointError(f"{tf.path}: {lk.canonical}.weight{lk.fc} is not a 2-D tensor")
            for j in range(local_experts):
                name = f"{lk.canonical}.{ep * local_experts + j}.linear_fc{lk.fc}.weight"
                yield name, _GroupedExpert(value, lk.fc, j, local_experts)
            return
        if value is None and lk.canonical.endswith("._extra_state"):
            # local linears save `_extra_state: None`; writers re-create it for the target modules
            self.linear_extra_state = True
            return
        if lk.kind == "expert" and lk.local_expert >= local_experts:
            raise CheckpointError(f"{tf.path}: local expert {lk.local_expert} but args say "
                                  f"{self.spec.num_experts} experts over EP={self.spec.num_experts // local_experts}")
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
        if self.spec.num_experts:
            for layer_id in self.spec.moe_layer_ids:
                prefix = f"{layer_module_prefix(layer_id)}.mlp.experts."
                found = {n[len(prefix):].split(".")[0] for n in self._entries if n.startswith(prefix)}
                if len(found) != self.spec.num_experts:
                    raise CheckpointError(
                        f"{self.path}: MoE layer {layer_id} holds {len(found)} experts but args say "
                        f"num_experts={self.spec.num_experts}; the checkpoint is incomplete")

    # -- ModelView ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str):
        entry = self._entries[name]
        if entry.rule.kind == REPLICATED or entry.parts == 1:
            return entry.shards[0].load()
        return join([entry.shards[r].load() for r in range(entry.parts)], entry.rule)

    def shape(self, name: str):
        return _full_shape(self._entries[name])

    def dtype(self, name: str):
        return self._entries[name].shards[0].dtype


def canonical_sort_key(name: str):
    """Embedding first, decoder layers in order (experts by id), final norm/output, then MTP."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if m:
        e = re.match(r"^mlp\.experts\.(\d+)\.(.*)$", m.group(2))
        return (1, int(m.group(1)), 1 if e else 0, int(e.group(1)) if e else 0, name)
    m = re.match(r"^mtp\.layers\.(\d+)\.(.*)$", name)
    if m:
        return (3, int(m.group(1)), 0, 0, name)
    if name.startswith("embedding."):
        return (0, 0, 0, 0, name)
    return (2, 0, 0, 0, name)


# -- the writer ------------------------------------------------------------------------------

def target_args(view: ModelView, target: ParallelLayout):
    """The source `args` with the target layout and the view's expert/router settings."""
    if view.args is None:
        raise CheckpointError("the source has no Megatron args; a legacy checkpoint needs them")
    args = writable_args(view.args, needed=DEFAULTS)
    spec = view.spec
    updates = dict(
        tensor_model_parallel_size=target.tp, pipeline_model_parallel_size=target.pp,
        expert_model_parallel_size=target.ep, expert_tensor_parallel_size=target.etp,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        # the writers lay out plain stages (stage_layers, MTP on the last): a source's layout string
        # would contradict them, so it goes (and with it the virtual stages it implied)
        pipeline_model_parallel_layout=None,
        moe_grouped_gemm=target.expert_layout != SEQUENTIAL,
        num_experts=spec.num_experts, moe_router_topk=spec.topk,
        moe_router_num_groups=spec.num_groups, moe_router_group_topk=spec.group_topk,
    )
    counts = target.stage_layers
    if getattr(args, "num_layer_list", None):  # MindSpeed spelling of uneven stages
        updates["num_layer_list"] = ",".join(map(str, counts)) if target.uneven else None
    else:
        first_last = _first_last(counts)
        updates["decoder_first_pipeline_num_layers"], updates["decoder_last_pipeline_num_layers"] = first_last
    for key, value in updates.items():
        setattr(args, key, value)
    return args


def _first_last(counts: tuple[int, ...]) -> tuple[int | None, int | None]:
    """Express stage sizes as Megatron's first/last stage sizes (middle stages even)."""
    if len(set(counts)) == 1:
        return None, None
    for first in (counts[0], None):
        for last in (None, counts[-1]):
            try:
                if stage_layer_counts(sum(counts), len(counts), first, last) == tuple(counts):
                    return first, last
            except Exception:  # noqa: BLE001 - try the next spelling
                continue
    raise CheckpointError(f"stage sizes {list(counts)} cannot be expressed with Megatron's first/last "
                          "stage sizes; give even middle stages")


def resolve_target(view: ModelView, tp=None, pp=None, ep=None, etp=None, expert_layout=None,
                   stage_layers=None) -> ParallelLayout:
    """Fill a target layout from the options given, defaulting to 1 / the source's expert layout,
    and check the whole plan (divisibility of every sharded dimension) before a byte is moved."""
    src = getattr(view, "layout", None)
    pp = pp or 1
    counts = tuple(stage_layers) if stage_layers else stage_layer_counts(
        view.spec.num_layers, pp, where="target pipeline split")
    target = ParallelLayout(tp=tp or 1, pp=pp, ep=ep or 1, etp=etp, expert_layout=expert_layout or
                            (src.expert_layout if src else SEQUENTIAL), stage_layers=counts)
    check_target(view, target)
    return target


def check_target(view: ModelView, target: ParallelLayout) -> None:
    """`check_fits`, and the one limit of legacy folders: ETP must be 1 or TP."""
    check_fits(view, target)
    if target.etp not in (1, target.tp):
        raise CheckpointError(f"target ETP={target.etp} must be 1 or equal to TP={target.tp}: legacy "
                              "rank folders cannot say which other expert shard they hold")


def stage_of(name: str, target: ParallelLayout) -> int:
    m = re.match(r"^decoder\.layers\.(\d+)\.", name)
    if m:
        layer, acc = int(m.group(1)), 0
        for p, n in enumerate(target.stage_layers):
            acc += n
            if layer < acc:
                return p
        raise CheckpointError(f"{name}: layer beyond the target's {acc} layers")
    return 0 if name.startswith("embedding.") else target.pp - 1


class _RankOut:
    """One output rank file being streamed."""

    def __init__(self, path: Path, coords: tuple[int, int, int]):
        from mcore_proxy.checkpoint.torchfile import TorchFileWriter

        path.parent.mkdir(exist_ok=True)  # inside the iteration folder: never re-creates a removed root
        self.coords, self.path = coords, path
        self.writer = TorchFileWriter(path)
        self.model: dict = {}
        self.grouped: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def add(self, key: str, value) -> None:
        if not isinstance(value, torch.Tensor):
            check_writable(value, f"model entry {key}")
        self.model[key] = self.writer.add(value) if isinstance(value, torch.Tensor) else value


def _shard_for(tensor, rule, parts: int, index: int):
    from mcore_proxy.sharding import split
    return split(tensor, rule, parts)[index] if parts > 1 else tensor


def _expert_local(name: str, target: ParallelLayout, num_experts: int):
    """-> (ep rank, local key prefix, local expert j, rest) for an expert tensor name."""
    from mcore_proxy.checkpoint.names import split_expert_name
    prefix, e, rest = split_expert_name(name)
    per = num_experts // target.ep
    return e // per, prefix, e % per, rest


def write_stage(view: ModelView, it_dir: Path, target: ParallelLayout, stage: int, args, header: dict,
                extra_state: bool, variants=frozenset(), ranks=None, progress=None) -> list[Path]:
    """Write every rank file of one pipeline stage, reading each canonical tensor once.

    Memory: one canonical tensor, plus one layer's local experts for a GroupedMLP target.
    `ranks`: optional subset of (tp, ep) coordinates to write (parallel workers split on it).
    """
    from mcore_proxy.checkpoint.names import GROUPED, local_expert_key, restore_variant, to_local_layer

    offset = sum(target.stage_layers[:stage])
    coords = [(t, e) for t in range(target.tp) for e in range(target.ep) if ranks is None or (t, e) in ranks]
    outs = {c: _RankOut(it_dir / rank_dir_name(c[0], stage, c[1], target) / RANK_FILE, (c[0], stage, c[1]))
            for c in coords}
    # MTP layers sit on the last stage, which then holds its own copy of the word embeddings
    # (megatron-core builds `embedding` wherever `mtp_process`; tied to the first stage's)
    mtp_embedding = view.spec.mtp_layers and stage == target.pp - 1
    names = [n for n in view.names()
             if stage_of(n, target) == stage or (mtp_embedding and n.startswith("embedding."))]
    num_experts = view.spec.num_experts
    per = num_experts // target.ep if num_experts else 0
    for name in names:
        rule = rule_for(name, view.layer_spec)
        if rule.expert:
            ep, prefix, j, rest = _expert_local(name, target, num_experts)
            dests = [c for c in coords if c[1] == ep]
        else:
            dests = coords
        if not dests:
            continue
        tensor = view.get(name)
        if progress is not None and isinstance(tensor, torch.Tensor):
            progress.update(tensor.numel() * tensor.element_size())
        parts = target.etp if rule.group == "etp" else target.tp
        for c in dests:
            index = 0 if parts == 1 else c[0]
            shard = _shard_for(tensor, rule, parts, index)
            out = outs[c]
            if not rule.expert:
                key = restore_variant(to_local_layer(name, offset), variants)
                out.add(key, shard)
                if extra_state and LINEAR_WEIGHT.match(key):
                    out.add(key[:-len(".weight")] + "._extra_state", None)
                continue
            local_prefix = to_local_layer(prefix, offset)
            if target.expert_layout == GROUPED:
                _add_grouped(out, local_prefix, j, rest, shard, per)
            else:
                key = local_expert_key(local_prefix, j, rest, target.expert_layout)
                out.add(key, shard)
                if extra_state and target.expert_layout == SEQUENTIAL and rest.endswith(".weight"):
                    out.add(key[:-len(".weight")] + "._extra_state", None)
        del tensor
    paths = []
    for out in outs.values():
        if out.grouped:
            raise CheckpointError(f"{out.path}: incomplete GroupedMLP experts {sorted(out.grouped)}")
        state = dict(header)
        state["args"] = args
        state["model"] = out.model
        out.writer.close(state)
        paths.append(out.path)
    return paths


def _add_grouped(out: _RankOut, prefix: str, j: int, rest: str, shard: torch.Tensor, per: int) -> None:
    """Collect one layer's local expert shards; emit weight1 [H, El*n] / weight2 [El*m, H] when complete."""
    fc = {"linear_fc1.weight": 1, "linear_fc2.weight": 2}.get(rest)
    if fc is None:
        raise CheckpointError(f"{prefix}.{j}.{rest}: GroupedMLP stores only expert fc1/fc2 weights; "
                              "write this checkpoint with the sequential expert layout")
    pending = out.grouped.setdefault((prefix, fc), {})
    pending[j] = shard.t()
    if len(pending) == per:
        stacked = torch.stack([pending[i] for i in range(per)])      # [El, H, n] or [El, m, H]
        rows = stacked.shape[1] if fc == 1 else stacked.shape[0] * stacked.shape[1]
        out.add(f"{prefix}.weight{fc}", stacked.reshape(rows, -1))
        del out.grouped[(prefix, fc)]


def legacy_units(target: ParallelLayout) -> list[tuple[int, int, int]]:
    """Every output rank file as (stage, tp, ep): the unit parallel writers split."""
    return [(p, t, e) for p in range(target.pp) for t in range(target.tp) for e in range(target.ep)]


def iteration_subdir(view: ModelView) -> str:
    it = view.iteration if view.iteration is not None else 0
    return "release" if it == "release" else f"iter_{int(it):07d}"


def write_legacy_units(view: ModelView, root: Path, target: ParallelLayout, units, progress=None) -> list[Path]:
    """Write the given output rank files (see `legacy_units`) under `root/iter_*/`."""
    args = target_args(view, target)
    iteration = view.iteration if view.iteration is not None else 0
    header = {"checkpoint_version": checkpoint_version(view),
              "iteration": 0 if iteration == "release" else iteration}
    extra_state = getattr(view, "linear_extra_state", True)
    variants = frozenset(getattr(view, "variants", ()))
    paths = []
    it_dir = Path(root) / iteration_subdir(view)
    it_dir.mkdir(exist_ok=True)
    for stage in sorted({u[0] for u in units}):
        ranks = {(t, e) for p, t, e in units if p == stage}
        paths += write_stage(view, it_dir, target, stage, args, header,
                             extra_state, variants, ranks=ranks, progress=progress)
    return paths


def checkpoint_version(view: ModelView) -> float:
    """The source's `checkpoint_version` (Megatron's format revision, a number), 3.0 if absent."""
    version = getattr(view, "checkpoint_version", None)
    if version is None:
        return 3.0
    if isinstance(version, bool) or not isinstance(version, (int, float)):
        raise CheckpointError(f"the source's checkpoint_version is {str(version)[:60]}, not a number; the "
                              "checkpoint is damaged, copy it again from the source")
    return version


def tracker_marker(view: ModelView) -> dict[str, bytes]:
    """The tracker file (relative path -> bytes): written last, it marks the checkpoint complete
    for Megatron, so writers hand it to the caller instead of writing it (see output.write_markers)."""
    it = view.iteration if view.iteration is not None else 0
    return {TRACKER: str(it).encode()}


def write_legacy(view: ModelView, out: str | Path, target: ParallelLayout, *, inputs=(), progress=True) -> Path:
    """Write `view` as a legacy checkpoint at `target` into `out` (created; must not exist).

    Optimizer and RNG state are not written; `iteration` and `checkpoint_version` are kept.
    Output goes to a hidden temporary folder renamed at the end, the tracker file last.
    """
    from tqdm import tqdm

    from mcore_proxy.checkpoint.output import staged_output, write_markers
    from mcore_proxy.memory import return_freed_buffers_to_os

    return_freed_buffers_to_os()
    check_target(view, target)
    total = sum(tensor_nbytes(view, n) for n in view.names())
    with staged_output(out, inputs, check_space=False) as tmp, \
            tqdm(total=total, **BYTES_PROGRESS, mininterval=2, desc="write legacy",
                 disable=not progress) as bar:
        write_legacy_units(view, tmp, target, legacy_units(target), progress=bar)
        write_markers(tmp, tracker_marker(view))
    return Path(out)
