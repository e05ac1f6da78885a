"""The target of a write: its parallel layout, whether the model fits it, the args it stores.

Shared by every Megatron format's writer and by `convert`: `resolve_target` (options given,
defaults 1) and `source_target` (defaults: the source's layout) fill a ParallelLayout and run
`check_fits` before a byte is written; `target_args` are the source `args` rewritten for the
target and the view's experts and router.
"""
from __future__ import annotations

import dataclasses

from mcore_proxy.checkpoint.layout import ParallelLayout, stage_layer_counts
from mcore_proxy.checkpoint.names import GROUPED, OUTPUT_LAYER, SEQUENTIAL, embeddings_tied, layer_number
from mcore_proxy.checkpoint.safe_globals import writable_args
from mcore_proxy.checkpoint.view import holds_fp8
from mcore_proxy.errors import CheckpointError, ProxyError
from mcore_proxy.megatron_args import DEFAULTS
from mcore_proxy.sharding import TE_SPEC, rule_for


def check_fits(view, target: ParallelLayout) -> None:
    """Whether megatron can hold `view` at `target`: stage sizes, EP dividing the expert count,
    heads and every sharded dimension dividing over TP/ETP. Checked before a byte is written."""
    spec = view.spec
    if holds_fp8(view):
        raise CheckpointError(f"{view.info.path or 'the checkpoint'}: FP8 weights with block scales have no Megatron "
                              "layout; pass --dequantize-fp8 to write them as bf16")
    if sum(target.stage_layers) != spec.num_layers or min(target.stage_layers) < 1:
        raise CheckpointError(f"target stages {list(target.stage_layers)} must each hold a layer and sum "
                              f"to num_layers={spec.num_layers}")
    if spec.num_experts and spec.num_experts % target.ep:
        raise CheckpointError(f"{spec.num_experts} experts do not divide over target EP={target.ep}; "
                              "choose an expert-parallel size that divides the expert count")
    for attr in ("num_attention_heads", "num_query_groups"):
        n = getattr(view.args, attr, None) if view.args is not None else None
        if n and int(n) % target.tp:
            raise CheckpointError(f"{attr}={n} does not divide over target TP={target.tp}")
    for name in view.names():
        rule = rule_for(name, view.layer_spec)
        parts, shape = rule.parts(target), view.shape(name)
        if shape is not None and not rule.divides(shape, parts):
            raise CheckpointError(f"{name} dimension {rule.dim} ({shape[rule.dim]}) does not divide over "
                                  f"{'ETP' if rule.group == 'etp' else 'TP'}={parts}; choose a size that divides it")


def resolve_target(view, tp=None, pp=None, ep=None, etp=None, expert_layout=None,
                   stage_layers=None) -> ParallelLayout:
    """Fill a target layout from the options given, defaulting to 1 / the source's expert layout,
    and check the whole plan (divisibility of every sharded dimension) before a byte is moved."""
    src = view.info.layout
    pp = pp or 1
    counts = tuple(stage_layers) if stage_layers else stage_layer_counts(
        view.spec.num_layers, pp, where="target pipeline split")
    target = ParallelLayout(tp=tp or 1, pp=pp, ep=ep or 1, etp=etp, expert_layout=expert_layout or
                            (src.expert_layout if src else SEQUENTIAL), stage_layers=counts)
    check_fits(view, target)
    return target


def complete_target(view, target: ParallelLayout) -> ParallelLayout:
    """`target` with stage sizes filled in (an even split) when it gives none."""
    if target.stage_layers is not None:
        return target
    return dataclasses.replace(target, stage_layers=stage_layer_counts(view.spec.num_layers, target.pp,
                                                                        where="target pipeline split"))


def source_target(view, tp=None, pp=None, ep=None, etp=None, expert_layout=None,
                  stage_layers=None) -> ParallelLayout:
    """`resolve_target` with the source's layout as the default: its TP, PP (and stage sizes,
    when PP is kept and there are no virtual stages), EP, and ETP when it is 1 or TP."""
    src = view.info.layout
    tp_ = tp or (src.tp if src else 1)
    pp_ = pp or (src.pp if src else 1)
    etp_ = etp or (src.etp if src and src.etp in (1, src.tp) and not tp else None)
    # a layout string's stages per pipeline rank are kept as a plain (first/last) split: the writers
    # write no layout string nor virtual stages (MTP goes to the last stage)
    stages = stage_layers or (src.stage_layers if src and src.pp == pp_ and (src.vpp == 1 or src.pipeline_layout)
                              else None)
    return resolve_target(view, tp=tp_, pp=pp_, ep=ep or (src.ep if src else 1), etp=etp_,
                          expert_layout=expert_layout, stage_layers=stages)


def first_last(counts: tuple[int, ...]) -> tuple[int | None, int | None]:
    """Express stage sizes as Megatron's first/last stage sizes (middle stages even)."""
    if len(set(counts)) == 1:
        return None, None
    for first in (counts[0], None):
        for last in (None, counts[-1]):
            try:
                if stage_layer_counts(sum(counts), len(counts), first, last) == tuple(counts):
                    return first, last
            except ProxyError:  # not expressible with this spelling: try the next
                continue
    raise CheckpointError(f"stage sizes {list(counts)} cannot be expressed with Megatron's first/last "
                          "stage sizes; give even middle stages")


def target_args(view, target: ParallelLayout):
    """A copy of the source `args` with the target layout and the view's expert/router settings
    (fields that may not be written are dropped: `safe_globals.writable_args`)."""
    if view.args is None:
        raise CheckpointError(f"the source has no Megatron args; a {view.info.format} source without them "
                              "cannot be written as a Megatron checkpoint, convert from one that has them")
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
        # said explicitly: the writers place (or leave out) the tied output copy by it
        untie_embeddings_and_output_weights=not embeddings_tied(view.args, OUTPUT_LAYER in view.names()),
    )
    if view.layer_spec == TE_SPEC and target.expert_layout != SEQUENTIAL:
        # the TE spec builds TEGroupedMLP (`linear_fc1.weight{j}`) for --moe-grouped-gemm unless the
        # legacy GroupedMLP (`weight1`/`weight2`) is asked for (TESpecProvider.grouped_mlp_modules)
        updates["moe_use_legacy_grouped_gemm"] = target.expert_layout == GROUPED
    counts = target.stage_layers
    if getattr(args, "num_layer_list", None):  # MindSpeed spelling of uneven stages
        updates["num_layer_list"] = ",".join(map(str, counts)) if target.uneven else None
    else:
        updates["decoder_first_pipeline_num_layers"], updates["decoder_last_pipeline_num_layers"] = first_last(counts)
    for key, value in updates.items():
        setattr(args, key, value)
    return args


def checkpoint_version(view) -> float:
    """The source's `checkpoint_version` (Megatron's format revision, a number), 3.0 if absent."""
    version = view.info.checkpoint_version
    if version is None:
        return 3.0
    if isinstance(version, bool) or not isinstance(version, (int, float)):
        raise CheckpointError(f"the source's checkpoint_version is {str(version)[:60]}, not a number; the "
                              "checkpoint is damaged, copy it again from the source")
    return version


def stage_of(name: str, target: ParallelLayout) -> int:
    """The pipeline stage a canonical name lives on at `target` (embeddings first, the rest last)."""
    layer = layer_number(name)
    if layer is not None:
        acc = 0
        for p, n in enumerate(target.stage_layers):
            acc += n
            if layer < acc:
                return p
        raise CheckpointError(f"{name}: layer beyond the target's {acc} layers")
    return 0 if name.startswith("embedding.") else target.pp - 1
