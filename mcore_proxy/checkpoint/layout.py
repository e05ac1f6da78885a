"""Parallel layouts: TP/PP/EP/ETP, virtual stages, the global layer offset of every stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcore_proxy.checkpoint.names import EXPERT_LAYOUTS, SEQUENTIAL
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.megatron_args import arg, arg_bool, arg_int


def stage_layer_counts(
    num_layers: int,
    pp: int,
    first: int | None = None,
    last: int | None = None,
    num_layer_list=None,
    where: str = "args",
) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as Megatron (first/last stage sizes) or MindSpeed
    (`num_layer_list`) define them; the middle stages split the rest evenly."""
    if num_layer_list:
        counts = tuple(
            int(x) for x in (num_layer_list.split(",") if isinstance(num_layer_list, str) else num_layer_list)
        )
        if len(counts) != pp or sum(counts) != num_layers:
            raise ProxyError(
                f"{where}: num_layer_list {list(counts)} must have {pp} entries summing to num_layers={num_layers}"
            )
        return counts
    if pp == 1:
        return (num_layers,)
    head = [first] if first else []
    tail = [last] if last else []
    middle_stages = pp - len(head) - len(tail)
    rest = num_layers - sum(head) - sum(tail)
    if middle_stages < 0 or rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
        raise ProxyError(
            f"{where}: {num_layers} layers cannot be split over {pp} pipeline stages with "
            f"first={first} last={last}; give sizes that add up"
        )
    middle = [rest // middle_stages] * middle_stages if middle_stages else []
    return tuple(head + middle + tail)


@dataclass(frozen=True)
class ParallelLayout:
    """How a checkpoint is (or will be) sharded.

    stage_layers: decoder layers per pipeline stage (sums to num_layers); with virtual stages
    (vpp > 1) each stage holds vpp chunks of equal size, Megatron's interleaved order, unless
    pipeline_layout (Megatron's `--pipeline-model-parallel-layout` string, `pipeline_layout.py`)
    says which layers every (stage, virtual chunk) holds.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    expert_layout: str = SEQUENTIAL
    stage_layers: tuple[int, ...] | None = None
    pipeline_layout: str | None = None
    # MindSpeed-LLM --moe-tp-extend-ep: experts spread over EP x TP ranks, whole (no expert TP);
    # rank (tp, ep) holds expert chunk ep * TP + tp (`expert_chunk`)
    tp_extend_ep: bool = False
    # the names written (writers): None megatron-core's, or a `mindspeed_llm.MindSpeedNaming`
    naming: object | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "pp", "ep", "etp", "vpp"):
            if getattr(self, name) < 1:
                raise ProxyError(f"parallel size {name}={getattr(self, name)} must be at least 1")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ProxyError(f"expert layout {self.expert_layout!r} is not one of {EXPERT_LAYOUTS}")
        if self.tp_extend_ep and self.etp != 1:
            raise ProxyError(
                f"--moe-tp-extend-ep keeps experts whole: expert tensor parallel size must be 1, not {self.etp}"
            )
        if self.stage_layers is not None and len(self.stage_layers) != self.pp:
            raise ProxyError(f"stage_layers {self.stage_layers} must have pp={self.pp} entries")

    @property
    def uneven(self) -> bool:
        return self.stage_layers is not None and len(set(self.stage_layers)) > 1

    def chunk_offsets(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(stage, virtual chunk) -> (global offset of its first layer, layer count)."""
        if self.pipeline_layout:
            from mcore_proxy.mcore.pipeline_layout import parse_pipeline_layout

            stages = parse_pipeline_layout(self.pipeline_layout, self.pp).stages
            return {(s.pp, s.vp): (s.decoder[0] if s.decoder else 0, len(s.decoder)) for s in stages}
        counts = self.stage_layers
        if self.vpp == 1:
            out, acc = {}, 0
            for p, n in enumerate(counts):
                out[(p, 0)] = (acc, n)
                acc += n
            return out
        if len(set(counts)) != 1 or counts[0] % self.vpp:
            raise CheckpointError("virtual pipeline stages with uneven stages are not supported")
        per_chunk = counts[0] // self.vpp
        return {(p, v): ((v * self.pp + p) * per_chunk, per_chunk) for p in range(self.pp) for v in range(self.vpp)}

    @property
    def expert_ranks(self) -> int:
        """Ranks the routed experts are spread over: EP, or EP x TP with --moe-tp-extend-ep."""
        return self.ep * self.tp if self.tp_extend_ep else self.ep

    def expert_chunk(self, tp: int, ep: int) -> int:
        """Which of the `expert_ranks` chunks of consecutive experts rank folder (tp, ep) holds."""
        return ep * self.tp + tp if self.tp_extend_ep else ep

    def stages(self, mtp_layers: int = 0):
        """Every (pp, vp) model chunk as a `pipeline_layout.PipelineLayout`: parsed from the layout
        string, else the chunks megatron-core builds from the stage sizes (MTP layers last)."""
        from mcore_proxy.mcore.pipeline_layout import chunk_stages, parse_pipeline_layout

        if self.pipeline_layout:
            return parse_pipeline_layout(self.pipeline_layout, self.pp)
        offsets = self.chunk_offsets()
        return chunk_stages(
            [offsets[(k % self.pp, k // self.pp)][1] for k in range(self.pp * self.vpp)], self.pp, mtp_layers
        )

    def describe(self) -> str:
        s = f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.etp}"
        if self.tp_extend_ep:
            s += " tp-extend-ep"
        if self.naming is not None:
            s += f" names {self.naming.describe()}"
        if self.vpp > 1:
            s += f" VPP={self.vpp}"
        if self.pipeline_layout:
            s += f" layout={self.pipeline_layout!r}"
        elif self.uneven:
            s += f" stages={list(self.stage_layers)}"
        return s


def rank_dir_name(tp: int, pp: int, ep: int, layout: ParallelLayout) -> str:
    """Megatron's legacy rank folder: `mp_rank_TT`, `_PPP` if PP > 1, `_EEE` if EP > 1."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def layout_from_args(args, folder) -> ParallelLayout:
    """The saving run's layout from its args (absent fields: Megatron's defaults); `folder` names
    the checkpoint in messages. MindSpeed-LLM's `moe_tp_extend_ep` makes experts whole (ETP 1)."""
    layout = _layout_from_args(args, folder)
    if arg_bool(args, "moe_tp_extend_ep", str(folder)):
        return dataclasses.replace(layout, etp=1, tp_extend_ep=True)
    return layout


def _layout_from_args(args, folder) -> ParallelLayout:
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
        raise CheckpointError(
            f"{folder}: args num_layer_list is a {type(layer_list).__name__}, expected "
            "comma-separated stage sizes; fix the args"
        )
    try:
        counts = stage_layer_counts(
            num_layers,
            pp,
            size("decoder_first_pipeline_num_layers"),
            size("decoder_last_pipeline_num_layers"),
            layer_list,
            where=where,
        )
    except ProxyError:
        raise
    except (ValueError, TypeError):  # a num_layer_list entry that is not a number
        raise CheckpointError(
            f"{folder}: args num_layer_list {layer_list!r} is not comma-separated stage sizes; fix the args"
        ) from None
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, stage_layers=counts)


def _layout_from_string(args, text, tp, pp, ep, etp, num_layers, where) -> ParallelLayout:
    """The layout of a run saved with `--pipeline-model-parallel-layout` (validated as
    megatron-core does); stage_layers are each pipeline rank's decoder layers over its chunks."""
    from mcore_proxy.mcore.pipeline_layout import parse_pipeline_layout

    if not isinstance(text, str):
        raise CheckpointError(
            f"{where}: args pipeline_model_parallel_layout is a {type(text).__name__}, "
            "expected Megatron's layout string; fix the args"
        )
    mtp = arg_int(args, "mtp_num_layers", where) or 0
    try:
        parsed = parse_pipeline_layout(text, pp, num_layers, mtp)
    except ProxyError as err:
        raise CheckpointError(f"{where}: {err}") from None
    counts = tuple(sum(len(s.decoder) for s in parsed.stages if s.pp == p) for p in range(pp))
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=parsed.vpp, stage_layers=counts, pipeline_layout=text)
