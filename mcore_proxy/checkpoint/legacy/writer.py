"""Megatron legacy (`torch`) checkpoints, written from any ModelView at a target layout.

Units: one per (pipeline stage, EP rank): the TP rank files `mp_rank_TT[_PPP][_EEE]` of that
stage and EP rank (each file's `model`, or with virtual stages `model0`, `model1`, ... for its
chunks, local layer numbers restarting at 0 in each, as Megatron-LM's `generate_state_dict`
writes them; which chunk holds what: `target.chunks_of`). The units of one stage that one process
writes (all of them in a single process; a share under `--workers` or torchrun) are written
together, so every tensor is read once for all the files holding it: an expert for its ETP shards,
a non-expert tensor for every EP rank (each EP rank file holds a copy; reading it once per EP rank
cost T reads at target EP T, bench/RESULTS.md "Real width"). Each tensor is sliced once per
destination file (`ShardRule.shard`), never split whole for every rank.

Optimizer and RNG state are not written; `iteration` and `checkpoint_version` are kept. Local
linears get their `_extra_state: None` entries when the source had them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.interface import NAMINGS, Finished, Unit, WrittenFile, Writer
from mcore_proxy.checkpoint.iteration import folder_name, header_iteration, tracker_marker
from mcore_proxy.checkpoint.layout import ParallelLayout, rank_dir_name
from mcore_proxy.checkpoint.legacy.reader import RANK_FILE
from mcore_proxy.checkpoint.mindspeed_llm import (
    MegatronNamedView,
    MindSpeedNamedView,
    has_extra_state,
    naming_args,
    written_naming,
)
from mcore_proxy.checkpoint.mindspeed_llm_v4 import MindSpeedV4Naming, MindSpeedV4NamedView, mindspeed_args
from mcore_proxy.checkpoint.mindspeed_llm_v4 import launch_flags as mindspeed_v4_launch_flags
from mcore_proxy.checkpoint.names import (
    GROUPED,
    OUTPUT_LAYER,
    SEQUENTIAL,
    TE_GROUPED,
    WORD_EMBEDDINGS,
    embeddings_tied,
    linear_extra_state,
    local_expert_key,
    restore_variant,
    split_expert_name,
    to_local_layer,
    to_mtp_model_layer,
)
from mcore_proxy.checkpoint.safe_globals import check_writable
from mcore_proxy.checkpoint.target import (
    check_fits,
    checkpoint_version,
    chunks_of,
    refuse_dsv4_tp,
    refuse_noop_layers,
    target_args,
)
from mcore_proxy.checkpoint.te_extra_state import empty_extra_state
from mcore_proxy.checkpoint.torchfile import TorchFileWriter
from mcore_proxy.checkpoint.view import ModelView, stream, tensor_nbytes
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.core.tensors import cat, is_tensor, stack
from mcore_proxy.mcore.sharding import rule_for

if TYPE_CHECKING:
    import torch


class _RankOut:
    """One output rank file being streamed: `model` or `model0`, `model1`, ... (`chunk_keys`)."""

    def __init__(self, root: Path, rel: str, chunk_keys: list[str]):
        path = Path(root) / rel
        path.parent.mkdir(exist_ok=True)  # inside the iteration folder: never re-creates a removed root
        self.rel, self.path = rel, path
        self.writer = TorchFileWriter(path)
        self.chunks: dict[str, dict] = {key: {} for key in chunk_keys}
        self.grouped: dict[tuple[str, str, int], dict[int, torch.Tensor]] = {}

    def add(self, chunk: str, key: str, value) -> None:
        """A tensor, the pieces of one (a GLU shard's gate and up rows), or a plain value."""
        pieces = value if isinstance(value, list) else [value]
        if not is_tensor(pieces[0]):
            check_writable(pieces[0], f"model entry {key}")
            self.chunks[chunk][key] = pieces[0]
        else:
            self.chunks[chunk][key] = self.writer.add_pieces(pieces)

    def close(self, header: dict) -> WrittenFile:
        if self.grouped:
            raise CheckpointError(f"{self.path}: incomplete GroupedMLP experts {sorted(self.grouped)}")
        self.writer.close({**header, **self.chunks})
        return WrittenFile(self.rel, self.writer.size, self.writer.sha256)


def chunk_key(target: ParallelLayout, vp: int) -> str:
    """Megatron-LM's state key of model chunk `vp`: `model`, or `model{vp}` with virtual stages."""
    return "model" if target.vpp == 1 else f"model{vp}"


def _stage_names(view: ModelView, target: ParallelLayout, stage: int) -> dict[str, list[tuple[str, int, str]]]:
    """name -> [(chunk key, global offset of the chunk's first layer, canonical name written as)]
    for the names pipeline rank `stage` holds: the embeddings twice when a chunk of it has the MTP
    layers beside the first, and the word embeddings once more as the last stage's tied output copy."""
    stages = target.stages(view.spec.mtp_layers)
    out = {}
    for name in view.names():
        held = [
            (chunk_key(target, s.vp), s.decoder[0] if s.decoder else 0, name)
            for s in chunks_of(name, stages)
            if s.pp == stage
        ]
        if held:
            out[name] = held
    if _tied_output_copy(view, target, stage):
        out.setdefault(WORD_EMBEDDINGS, []).extend(
            (chunk_key(target, s.vp), 0, OUTPUT_LAYER) for s in chunks_of(OUTPUT_LAYER, stages) if s.pp == stage
        )
    return out


def _tied_output_copy(view: ModelView, target: ParallelLayout, stage: int) -> bool:
    """Whether `stage` holds `output_layer.weight` as its copy of the word embeddings: with tied
    embeddings megatron-core allocates an output weight on the last stage unless it is also the
    first (`GPTModel`: `skip_weight_param_allocation=pre_process and share_embeddings...`)."""
    names = view.names()
    return (
        target.pp > 1
        and stage == target.pp - 1
        and WORD_EMBEDDINGS in names
        and embeddings_tied(view.args, OUTPUT_LAYER in names)
    )


def _ep_of(view: ModelView, name: str, target: ParallelLayout) -> int | None:
    """The EP rank holding an expert tensor (None for every other tensor)."""
    parts = split_expert_name(name) if rule_for(name, view.layer_spec).expert else None
    return None if parts is None else parts[1] // (view.spec.num_experts // target.ep)


def write_files(
    view: ModelView,
    root: Path,
    target: ParallelLayout,
    stage: int,
    eps: list[int],
    args,
    header: dict,
    progress=None,
) -> list[list[WrittenFile]]:
    """Write the TP rank files of pipeline stage `stage` for each EP rank in `eps`, reading each
    canonical tensor once (the next ones read ahead) and slicing it once per file; hashed while
    written, synced at close. -> the files of each EP rank, in the order of `eps`.

    Memory: one canonical tensor, plus one layer's local experts per EP rank for a GroupedMLP target."""
    it_dir = folder_name(view.iteration)
    keys = [chunk_key(target, v) for v in range(target.vpp)]
    outs = {
        ep: [
            _RankOut(root, f"{it_dir}/{rank_dir_name(t, stage, ep, target)}/{RANK_FILE}", keys)
            for t in range(target.tp)
        ]
        for ep in eps
    }
    extra_state, variants, naming = view.info.linear_extra_state, view.info.variants, view.info.naming
    num_experts = view.spec.num_experts
    per = num_experts // target.expert_ranks if num_experts else 0
    placed, holders = {}, {}
    for n, held in _stage_names(view, target, stage).items():
        owner = _ep_of(view, n, target)
        if owner is None or owner in outs:
            placed[n], holders[n] = held, list(outs) if owner is None else [owner]
    present = set(view.names())
    try:
        for name, tensor in stream(view, list(placed)):
            rule = rule_for(name, view.layer_spec)
            parts = rule.parts(target)
            for ep in holders[name]:
                for t, out in enumerate(outs[ep]):
                    if rule.expert and target.expert_chunk(t, ep) != split_expert_name(name)[1] // per:
                        continue  # --moe-tp-extend-ep: another TP rank's expert
                    # this rank's shard only, as views of the tensor (a GLU shard: its gate and up rows)
                    shard = rule.shard_pieces(tensor, parts, rule.shard_index(target, t)) if parts > 1 else [tensor]
                    for chunk, offset, written_as in placed[name]:
                        _add(
                            out,
                            chunk,
                            written_as,
                            shard,
                            offset,
                            rule,
                            target,
                            per,
                            extra_state,
                            variants,
                            present,
                            naming,
                        )
            if progress is not None:  # as `units` counts (an object's tensor: 0)
                size = tensor_nbytes(view, name) * _files_holding(rule, target) // rule.parts(target)
                progress(size * len(placed[name]) * len(holders[name]))
            del tensor
        return [[out.close({**header, "args": args}) for out in outs[ep]] for ep in eps]
    except BaseException:
        for files in outs.values():
            for out in files:
                out.writer.abort()
        raise


def _files_holding(rule, target: ParallelLayout) -> int:
    """TP rank files of one (stage, EP rank) holding a tensor: all, or one for an expert with
    --moe-tp-extend-ep."""
    return 1 if rule.expert and target.tp_extend_ep else target.tp


def _add(
    out: _RankOut,
    chunk: str,
    name: str,
    shard: list,
    offset: int,
    rule,
    target: ParallelLayout,
    per: int,
    extra_state: bool,
    variants,
    present: set[str],
    naming=None,
) -> None:
    """One rank's shard of canonical `name` into model chunk `chunk` under its rank-local key;
    `present`: the view's names (a linear whose extra state the view holds gets that, not None);
    `naming`: the MindSpeed-LLM naming written (its fused `linear_qkv` has no extra state)."""
    if not rule.expert:
        key = restore_variant(to_local_layer(name, offset), variants)
        out.add(chunk, key, shard)
        if (
            extra_state
            and (extra := linear_extra_state(key))
            and linear_extra_state(name) not in present
            and has_extra_state(key, naming)
        ):
            out.add(chunk, extra, None)
        return
    prefix, e, rest = split_expert_name(name)
    local_prefix = to_mtp_model_layer(to_local_layer(prefix, offset), variants)
    if rest.endswith("._extra_state") and target.expert_layout != SEQUENTIAL:
        return  # GroupedMLP has no extra state; TEGroupedMLP's is written once per linear, below
    if target.expert_layout == GROUPED:
        _add_grouped(out, chunk, local_prefix, e % per, rest, cat(shard) if len(shard) > 1 else shard[0], per)
        return
    key = local_expert_key(local_prefix, e % per, rest, target.expert_layout)
    out.add(chunk, key, shard)
    if target.expert_layout == TE_GROUPED and e % per == 0 and rest.endswith(".weight"):
        # one state for all local experts: TE's empty "no FP8 state" (te_extra_state.py)
        out.add(chunk, f"{local_prefix}.{rest[: -len('.weight')]}._extra_state", empty_extra_state())
    extra = linear_extra_state(key)
    if extra_state and target.expert_layout == SEQUENTIAL and extra and linear_extra_state(name) not in present:
        out.add(chunk, extra, None)


def _add_grouped(out: _RankOut, chunk: str, prefix: str, j: int, rest: str, shard: torch.Tensor, per: int) -> None:
    """Collect one layer's local expert shards; emit weight1 [H, El*n] / weight2 [El*m, H] when complete."""
    fc = {"linear_fc1.weight": 1, "linear_fc2.weight": 2}.get(rest)
    if fc is None:
        raise CheckpointError(
            f"{prefix}.{j}.{rest}: GroupedMLP stores only expert fc1/fc2 weights; "
            "write this checkpoint with the sequential expert layout"
        )
    pending = out.grouped.setdefault((chunk, prefix, fc), {})
    pending[j] = shard.t()
    if len(pending) == per:
        stacked = stack([pending[i] for i in range(per)])  # [El, H, n] or [El, m, H]
        rows = stacked.shape[1] if fc == 1 else stacked.shape[0] * stacked.shape[1]
        out.add(chunk, f"{prefix}.weight{fc}", stacked.reshape(rows, -1))
        del out.grouped[(chunk, prefix, fc)]


def _named(view: ModelView, target: ParallelLayout) -> ModelView:
    """The view under the names the target writes (checkpoint/mindspeed_llm.py)."""
    if isinstance(target.naming, MindSpeedV4Naming):
        return MindSpeedV4NamedView(view, target.naming)
    if target.naming is not None:
        return MindSpeedNamedView(view, target.naming)
    return view if view.info.naming is None else MegatronNamedView(view)


class LegacyWriter(Writer):
    """The legacy format's Writer (see `checkpoint/interface.py`). Names: megatron-core's, or
    MindSpeed-LLM's (`--naming`, by default the source's; checkpoint/mindspeed_llm.py)."""

    namings = NAMINGS
    tp_extend_ep = True

    def model_flags(self, view, target) -> list[str]:
        """MindSpeed-LLM's flags for its DeepSeek-V4 names; Megatron-LM's otherwise."""
        if isinstance(target.naming, MindSpeedV4Naming):
            return mindspeed_v4_launch_flags(mindspeed_args(view.args))
        return super().model_flags(view, target)

    def target(self, view, options):
        target = super().target(view, options)
        naming = written_naming(view, options.naming)
        source = view.info.layout
        extend = options.tp_extend_ep
        if extend is None:
            extend = bool(naming is not None and source is not None and source.tp_extend_ep)
        if extend:
            if options.etp not in (None, 1):
                raise CheckpointError(
                    f"--moe-tp-extend-ep keeps experts whole: --target-etp must be 1, not {options.etp}"
                )
            if view.spec.num_experts % (target.ep * target.tp):
                raise CheckpointError(
                    f"{view.spec.num_experts} experts do not divide over EP x TP = "
                    f"{target.ep * target.tp} ranks (--moe-tp-extend-ep); choose sizes that divide it"
                )
            target = dataclasses.replace(target, etp=1, tp_extend_ep=True)
        return dataclasses.replace(target, naming=naming)

    def check(self, view: ModelView, target: ParallelLayout) -> None:
        """`check_fits`, the one limit of legacy folders (ETP is 1 or TP), and the args and header
        it will store."""
        view = _named(view, target)
        refuse_noop_layers(view, "legacy", target)
        check_fits(view, target)
        refuse_dsv4_tp(view, target)
        if target.etp not in (1, target.tp):
            raise CheckpointError(
                f"target ETP={target.etp} must be 1 or equal to TP={target.tp}: legacy "
                "rank folders cannot say which other expert shard they hold"
            )
        target_args(view, target)
        checkpoint_version(view)

    def units(self, view: ModelView, target: ParallelLayout) -> list[Unit]:
        view = _named(view, target)
        sizes = {(p, e): 0 for p in range(target.pp) for e in range(target.ep)}
        for p in range(target.pp):
            for name, held in _stage_names(view, target, p).items():
                rule, ep = rule_for(name, view.layer_spec), _ep_of(view, name, target)
                # every TP file of the group holds a 1/parts shard, once per chunk holding it
                nbytes = tensor_nbytes(view, name) * _files_holding(rule, target) // rule.parts(target) * len(held)
                for e in range(target.ep) if ep is None else (ep,):
                    sizes[(p, e)] += nbytes
        return [Unit(key, n) for key, n in sizes.items()]

    def write_unit(
        self, view: ModelView, root: Path, target: ParallelLayout, unit: Unit, progress=None
    ) -> list[WrittenFile]:
        return self.write_units(view, root, target, [unit], progress)[0]

    def write_units(
        self, view: ModelView, root: Path, target: ParallelLayout, units: list[Unit], progress=None
    ) -> list[list[WrittenFile]]:
        """The given (stage, EP rank) units, each stage's EP ranks together (one read per tensor)."""
        view = _named(view, target)
        (Path(root) / folder_name(view.iteration)).mkdir(exist_ok=True)
        header = {"checkpoint_version": checkpoint_version(view), "iteration": header_iteration(view.iteration)}
        args = naming_args(target_args(view, target), target)
        eps_of: dict[int, list[int]] = {}
        for unit in units:
            eps_of.setdefault(unit.key[0], []).append(unit.key[1])
        done = {}
        for stage, eps in eps_of.items():
            written = write_files(view, Path(root), target, stage, eps, args, header, progress)
            done.update({(stage, ep): files for ep, files in zip(eps, written)})
        return [done[tuple(unit.key)] for unit in units]

    def finish(self, view: ModelView, root: Path, target: ParallelLayout, results) -> Finished:
        return Finished(files=(), markers=tracker_marker(view.iteration))
