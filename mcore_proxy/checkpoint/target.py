"""The target of a write: its parallel layout, whether the model fits it, the args it stores.

Shared by every Megatron format's writer and by `convert`: `resolve_target` (options given,
defaults 1) and `source_target` (defaults: the source's layout) fill a ParallelLayout and run
`check_fits` before a byte is written; `target_args` are the source `args` rewritten for the
target and the view's experts and router.
"""

from __future__ import annotations

import dataclasses

from mcore_proxy.checkpoint.layout import ParallelLayout, stage_layer_counts
from mcore_proxy.checkpoint.names import GROUPED, OUTPUT_LAYER, SEQUENTIAL, embeddings_tied, layer_number, mtp_depth
from mcore_proxy.checkpoint.safe_globals import writable_args
from mcore_proxy.checkpoint.view import holds_fp8
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.megatron_args import DEFAULTS, arg, arg_bool, arg_int, arg_str, num_query_groups
from mcore_proxy.mcore.sharding import TE_SPEC, rule_for


def refuse_noop_layers(view, fmt: str, target: ParallelLayout | None = None) -> None:
    """Noop layers (MindSpeed --noop-layers) are written to legacy files without virtual stages only:
    their gaps in the local layer numbers are what MindSpeed loads; the rest is not tested with them."""
    noop = list(view.spec.noop_layers)
    if not noop:
        return
    where = view.info.path or "the checkpoint"
    if fmt != "legacy":
        raise CheckpointError(
            f"{where}: has noop layers {noop} (MindSpeed --noop-layers), which mcore-proxy writes "
            f"to legacy checkpoints only, not {fmt}; choose --format legacy"
        )
    if target is not None and (target.vpp > 1 or target.pipeline_layout):
        raise CheckpointError(
            f"{where}: has noop layers {noop} (MindSpeed --noop-layers), which mcore-proxy writes "
            "with a plain stage split only; leave out --target-vpp and --target-pipeline-layout"
        )


def check_fits(view, target: ParallelLayout) -> None:
    """Whether megatron can hold `view` at `target`: stage sizes, EP dividing the expert count,
    heads and every sharded dimension dividing over TP/ETP. Checked before a byte is written."""
    spec = view.spec
    if holds_fp8(view):
        raise CheckpointError(
            f"{view.info.path or 'the checkpoint'}: FP8 weights with block scales have no Megatron "
            "layout; pass --dequantize to write them as bf16"
        )
    # a layout string may leave a pipeline rank without decoder layers (only MTP, or only the loss)
    fewest = 0 if target.pipeline_layout else 1
    if sum(target.stage_layers) != spec.num_layers or min(target.stage_layers) < fewest:
        raise CheckpointError(
            f"target stages {list(target.stage_layers)} must each hold a layer and sum to num_layers={spec.num_layers}"
        )
    if spec.num_experts and spec.num_experts % target.ep:
        raise CheckpointError(
            f"{spec.num_experts} experts do not divide over target EP={target.ep}; "
            "choose an expert-parallel size that divides the expert count"
        )
    if view.args is not None:
        # query groups as megatron-core counts them: without group_query_attention the saved
        # num_query_groups (argparse's 1) is ignored and every head is its own group
        heads, groups = arg_int(view.args, "num_attention_heads", minimum=1), num_query_groups(view.args)
        for attr, n in (("num_attention_heads", heads), ("num_query_groups", groups)):
            if n % target.tp:
                raise CheckpointError(f"{attr}={n} does not divide over target TP={target.tp}")
    for name in view.names():
        rule = rule_for(name, view.layer_spec)
        parts, shape = rule.parts(target), view.shape(name)
        if shape is not None and not rule.divides(shape, parts):
            raise CheckpointError(
                f"{name} dimension {rule.dim} ({shape[rule.dim]}) does not divide over "
                f"{'ETP' if rule.group == 'etp' else 'TP'}={parts}; choose a size that divides it"
            )


def refuse_dsv4_tp(view, target: ParallelLayout) -> None:
    """Megatron-LM dev's DeepSeek-V4 at TP > 1 (writers, on the view under the names they write:
    MindSpeed-LLM's DeepSeek-V4 is tensor parallel, checkpoint/mindspeed_llm_v4.py)."""
    if target.tp > 1 and arg_str(view.args, "experimental_attention_variant") == "dsv4_hybrid":
        raise CheckpointError(
            f"target TP={target.tp}: Megatron-LM runs DeepSeek-V4's hybrid attention at tensor-parallel "
            "size 1 only (deepseek_v4_hybrid_attention.py); give --target-tp 1 and spread the "
            "experts with --target-ep, or write MindSpeed-LLM's names (--naming mindspeed-llm), "
            "whose DeepSeek-V4 is tensor parallel"
        )


def pipeline_split(
    spec, pp: int, stage_layers=None, pipeline_layout: str | None = None, vpp: int | None = None
) -> tuple[tuple[int, ...], int, str | None]:
    """(decoder layers per pipeline rank, virtual stages per rank, layout string) of a target from
    the options given: Megatron's layout string (`--target-pipeline-layout`, validated against PP,
    num_layers and the MTP layers as megatron-core does), or Megatron's even interleaved split
    into `vpp` chunks per rank (`--target-vpp`: chunk (pp, vp) holds layers (vp*PP + pp)*n ..
    +n), or plain stage sizes (even by default). Contradictions are one sentence naming the flag."""
    from mcore_proxy.mcore.pipeline_layout import parse_pipeline_layout

    if pipeline_layout is not None:
        if stage_layers:
            raise CheckpointError(
                "--target-pipeline-layout and --target-stage-layers both say which layers each "
                "pipeline stage holds; give one of them"
            )
        try:
            parsed = parse_pipeline_layout(pipeline_layout, pp, spec.num_layers, spec.mtp_layers)
        except ProxyError as err:
            raise CheckpointError(f"--target-pipeline-layout: {err}") from None
        if vpp is not None and vpp != parsed.vpp:
            raise CheckpointError(
                f"--target-vpp {vpp} contradicts --target-pipeline-layout {pipeline_layout!r}, whose "
                f"{parsed.pp * parsed.vpp} stages are {parsed.vpp} virtual stages per pipeline rank at "
                f"PP={pp}; drop --target-vpp (the layout string sets it)"
            )
        counts = tuple(sum(len(s.decoder) for s in parsed.stages if s.pp == p) for p in range(pp))
        split = (counts, parsed.vpp, pipeline_layout)
    elif vpp is not None and vpp > 1:
        if stage_layers and len(set(stage_layers)) > 1:
            raise CheckpointError(
                f"--target-vpp {vpp} with uneven --target-stage-layers {','.join(map(str, stage_layers))}: "
                "the interleaved split needs even stages (MindSpeed refuses --num-layer-list with "
                "virtual stages); give a --target-pipeline-layout instead"
            )
        if spec.num_layers % (pp * vpp):
            raise CheckpointError(
                f"--target-vpp {vpp}: {spec.num_layers} decoder layers do not split evenly into "
                f"PP x VPP = {pp * vpp} chunks; choose sizes that divide it or give a "
                "--target-pipeline-layout"
            )
        split = ((spec.num_layers // pp,) * pp, vpp, None)
    else:
        counts = (
            tuple(stage_layers)
            if stage_layers
            else stage_layer_counts(spec.num_layers, pp, where="target pipeline split")
        )
        split = (counts, 1, None)
    if split[1] > 1 and pp == 1:
        raise CheckpointError(
            f"{'--target-pipeline-layout' if pipeline_layout else '--target-vpp'} asks for "
            f"{split[1]} virtual stages at PP=1, but Megatron's interleaved schedule needs PP > 1; "
            "give --target-pp 2 or more, or one stage per pipeline rank"
        )
    return split


def resolve_target(
    view, tp=None, pp=None, ep=None, etp=None, expert_layout=None, stage_layers=None, pipeline_layout=None, vpp=None
) -> ParallelLayout:
    """Fill a target layout from the options given, defaulting to 1 / the source's expert layout /
    no virtual stages, and check the whole plan (divisibility of every sharded dimension) before a
    byte is moved."""
    src = view.info.layout
    pp = pp or 1
    counts, vpp, text = pipeline_split(view.spec, pp, stage_layers, pipeline_layout, vpp)
    target = ParallelLayout(
        tp=tp or 1,
        pp=pp,
        ep=ep or 1,
        etp=etp,
        vpp=vpp,
        expert_layout=expert_layout or (src.expert_layout if src else SEQUENTIAL),
        stage_layers=counts,
        pipeline_layout=text,
    )
    check_fits(view, target)
    return target


def complete_target(view, target: ParallelLayout) -> ParallelLayout:
    """`target` with stage sizes filled in (an even split) when it gives none."""
    if target.stage_layers is not None:
        return target
    return dataclasses.replace(
        target, stage_layers=stage_layer_counts(view.spec.num_layers, target.pp, where="target pipeline split")
    )


def source_target(
    view, tp=None, pp=None, ep=None, etp=None, expert_layout=None, stage_layers=None, pipeline_layout=None, vpp=None
) -> ParallelLayout:
    """`resolve_target` with the source's layout as the default: its TP, PP, EP, ETP when it is 1
    or TP, and, when PP is kept and no stage option is given, its stages: the layout string or
    the virtual stages it was saved with (`vpp=1` asks for a plain split of its per-rank layer
    counts instead)."""
    src = view.info.layout
    tp_ = tp or (src.tp if src else 1)
    pp_ = pp or (src.pp if src else 1)
    etp_ = etp or (src.etp if src and src.etp in (1, src.tp) and not tp else None)
    keep = src is not None and src.pp == pp_ and stage_layers is None and pipeline_layout is None
    if keep and vpp is None and src.pipeline_layout:
        pipeline_layout = src.pipeline_layout
    elif keep and vpp is None and src.vpp > 1:
        vpp = src.vpp
    elif keep and vpp in (None, 1):  # its stage sizes (per pipeline rank over its chunks) as a plain split
        stage_layers = src.stage_layers
    return resolve_target(
        view,
        tp=tp_,
        pp=pp_,
        ep=ep or (src.ep if src else 1),
        etp=etp_,
        expert_layout=expert_layout,
        stage_layers=stage_layers,
        pipeline_layout=pipeline_layout,
        vpp=vpp,
    )


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
    raise CheckpointError(
        f"stage sizes {list(counts)} cannot be expressed with Megatron's first/last "
        "stage sizes; give even middle stages"
    )


def target_args(view, target: ParallelLayout):
    """A copy of the source `args` with the target layout and the view's expert/router settings
    (fields that may not be written are dropped: `safe_globals.writable_args`)."""
    if view.args is None:
        raise CheckpointError(
            f"the source has no Megatron args; a {view.info.format} source without them "
            "cannot be written as a Megatron checkpoint, convert from one that has them"
        )
    args = writable_args(view.args, needed=DEFAULTS)
    spec = view.spec
    vpp = target.vpp if target.vpp > 1 else None
    updates = dict(
        tensor_model_parallel_size=target.tp,
        pipeline_model_parallel_size=target.pp,
        expert_model_parallel_size=target.ep,
        expert_tensor_parallel_size=target.etp,
        # as Megatron-LM's validate_args leaves them: the raw layout string, VPP derived from it
        # (None for 1), or from --num-layers-per-virtual-pipeline-stage for the even split
        pipeline_model_parallel_layout=target.pipeline_layout,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=(
            target.stage_layers[0] // vpp if vpp and not target.pipeline_layout else None
        ),
        num_virtual_stages_per_pipeline_rank=None,
        overlap_p2p_comm=_overlap_p2p(view, args, vpp),
        moe_grouped_gemm=target.expert_layout != SEQUENTIAL,
        num_experts=spec.num_experts,
        moe_router_topk=spec.topk,
        moe_router_num_groups=spec.num_groups,
        moe_router_group_topk=spec.group_topk,
        # said explicitly: the writers place (or leave out) the tied output copy by it
        untie_embeddings_and_output_weights=not embeddings_tied(view.args, OUTPUT_LAYER in view.names()),
    )
    if view.layer_spec == TE_SPEC and target.expert_layout != SEQUENTIAL:
        # the TE spec builds TEGroupedMLP (`linear_fc1.weight{j}`) for --moe-grouped-gemm unless the
        # legacy GroupedMLP (`weight1`/`weight2`) is asked for (TESpecProvider.grouped_mlp_modules)
        updates["moe_use_legacy_grouped_gemm"] = target.expert_layout == GROUPED
    counts = target.stage_layers
    if target.pipeline_layout:  # the string says it all; Megatron refuses it with stage sizes beside it
        updates.update(
            decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None, num_layer_list=None
        )
    elif arg(args, "num_layer_list"):  # MindSpeed spelling of uneven stages
        updates["num_layer_list"] = ",".join(map(str, counts)) if target.uneven else None
    else:
        updates["decoder_first_pipeline_num_layers"], updates["decoder_last_pipeline_num_layers"] = first_last(counts)
    for key, value in updates.items():
        setattr(args, key, value)
    return args


def _overlap_p2p(view, args, vpp: int | None) -> bool:
    """`overlap_p2p_comm` as validate_args leaves it: off without interleaving; with it, the
    source's choice when it was interleaved too, else Megatron-LM's default (on)."""
    if not vpp:
        return False
    src = view.info.layout
    return arg_bool(args, "overlap_p2p_comm") if src is not None and src.vpp > 1 else True


def checkpoint_version(view) -> float:
    """The source's `checkpoint_version` (Megatron's format revision, a number), 3.0 if absent."""
    version = view.info.checkpoint_version
    if version is None:
        return 3.0
    if isinstance(version, bool) or not isinstance(version, (int, float)):
        raise CheckpointError(
            f"the source's checkpoint_version is {str(version)[:60]}, not a number; the "
            "checkpoint is damaged, copy it again from the source"
        )
    return version


def chunks_of(name: str, stages) -> tuple:
    """The model chunks (`pipeline_layout.Stage`, from `ParallelLayout.stages`) that hold canonical
    `name`, as megatron-core builds them: a decoder layer's chunk, an MTP layer's chunk; the
    embeddings on the first chunk and again on the MTP chunk (its own copy: `GPTModel` builds them
    where `mtp_process`); `decoder.final_layernorm` (and DeepSeek-V4's `decoder.hc_head_*`, which
    the block holds beside it) beside the last decoder layer with MTP, else on the last chunk
    (`PipelineLayout.final_norm_stage`); everything else (the output layer) on the last chunk."""
    layer = layer_number(name)
    if layer is not None:
        try:
            return (stages.stage_of_layer(layer)[0],)
        except IndexError:
            raise CheckpointError(f"{name}: layer beyond the target's {stages.num_layers} layers") from None
    depth = mtp_depth(name)
    if depth is not None:
        held = tuple(s for s in stages.stages if depth in s.mtp)
        if not held:
            raise CheckpointError(f"{name}: MTP layer beyond the target's {stages.mtp_layers} MTP layers")
        return held
    if name.startswith("embedding."):
        return tuple(s for s in stages.stages if s.embedding or s.mtp)
    if name.startswith(("decoder.final_layernorm.", "decoder.hc_head_")):
        return (stages.final_norm_stage,)
    return (stages.stages[-1],)
