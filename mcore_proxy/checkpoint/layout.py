"""Parallel layouts: TP/PP/EP/ETP, virtual stages, the global layer offset of every stage."""
from __future__ import annotations

from dataclasses import dataclass

from mcore_proxy.checkpoint.names import EXPERT_LAYOUTS, SEQUENTIAL
from mcore_proxy.errors import CheckpointError, ProxyError


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None,
                       num_layer_list=None, where: str = "args") -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as Megatron (first/last stage sizes) or MindSpeed
    (`num_layer_list`) define them; the middle stages split the rest evenly."""
    if num_layer_list:
        counts = tuple(int(x) for x in (num_layer_list.split(",") if isinstance(num_layer_list, str)
                                        else num_layer_list))
        if len(counts) != pp or sum(counts) != num_layers:
            raise ProxyError(f"{where}: num_layer_list {list(counts)} must have {pp} entries summing "
                             f"to num_layers={num_layers}")
        return counts
    if pp == 1:
        return (num_layers,)
    head = [first] if first else []
    tail = [last] if last else []
    middle_stages = pp - len(head) - len(tail)
    rest = num_layers - sum(head) - sum(tail)
    if middle_stages < 0 or rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
        raise ProxyError(f"{where}: {num_layers} layers cannot be split over {pp} pipeline stages with "
                         f"first={first} last={last}; give sizes that add up")
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

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "pp", "ep", "etp", "vpp"):
            if getattr(self, name) < 1:
                raise ProxyError(f"parallel size {name}={getattr(self, name)} must be at least 1")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ProxyError(f"expert layout {self.expert_layout!r} is not one of {EXPERT_LAYOUTS}")
        if self.stage_layers is not None and len(self.stage_layers) != self.pp:
            raise ProxyError(f"stage_layers {self.stage_layers} must have pp={self.pp} entries")

    @property
    def uneven(self) -> bool:
        return self.stage_layers is not None and len(set(self.stage_layers)) > 1

    def chunk_offsets(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(stage, virtual chunk) -> (global offset of its first layer, layer count)."""
        if self.pipeline_layout:
            from mcore_proxy.pipeline_layout import parse_pipeline_layout

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
        return {(p, v): ((v * self.pp + p) * per_chunk, per_chunk)
                for p in range(self.pp) for v in range(self.vpp)}

    def describe(self) -> str:
        s = f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.etp}"
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


def check_fits(view, target: ParallelLayout) -> None:
    """Whether megatron can hold `view` at `target`: stage sizes, EP dividing the expert count,
    heads and every sharded dimension dividing over TP/ETP. Checked before a byte is written."""
    from mcore_proxy.sharding import GLU_COLUMN, REPLICATED, ROW, rule_for

    spec = view.spec
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
        parts = target.etp if rule.group == "etp" else target.tp
        shape = view.shape(name)
        if rule.kind == REPLICATED or parts == 1 or shape is None:
            continue
        dim = 1 if rule.kind == ROW else 0
        size = shape[dim] // 2 if rule.kind == GLU_COLUMN else shape[dim]
        if size % parts:
            raise CheckpointError(f"{name} dimension {dim} ({shape[dim]}) does not divide over "
                                  f"{'ETP' if rule.group == 'etp' else 'TP'}={parts}; choose a size that divides it")
