"""Which decoder layers, MTP layers, embedding and loss each pipeline stage holds.

Three ways to lay a model out over pipeline stages are in use, and a reader or writer of
rank-local checkpoints must know which layers a `mp_rank_.._PPP` folder (and its `model{v}`
chunks) holds:

1. Megatron's `--pipeline-model-parallel-layout` string (megatron-core 0.16.1,
   `megatron/core/transformer/pipeline_parallel_layer_layout.py`, class
   `PipelineParallelLayerLayout`), parsed by `parse_pipeline_layout`:

   - Commas are cosmetic and removed first (`"Et*3|(tt|)*29,m|L"`).
   - Repetition is unrolled in two left-to-right passes that do not nest: first every
     `(BODY)*N` (BODY: one or more characters other than `)`), then every `X*N` for a single
     character X (any character, `|` included: `"|*3"` is three stage separators). N may be 0.
   - The result is split at `|` into stages; each character must be one of `E` (embedding), `t`
     (decoder layer), `m` (MTP layer), `L` (loss). Empty stages are allowed.
   - The number of stages must be a multiple of PP; VPP = stages / PP; stage k is
     (pp = k % PP, vp = k // PP). Layers are numbered in stage order k = 0, 1, ..., so the
     decoder layers of (pp, vp) follow all those of vp' < vp and of (pp' < pp, vp).
   - `validate_layer_layout` then requires: the first symbol of the flattened layout is `E` and
     the last `L`, each exactly once; the `t` count equals `num_layers`; the `m` count equals
     `mtp_num_layers` (0 when MTP is off); no `t` after the first `m`; all `m` in one stage,
     which is the last virtual stage of its pipeline rank. MTP on a rank other than the last is
     "standalone" (megatron sets `config.mtp_standalone`).
   - `E` and `L` are only validated: Megatron-LM builds the embedding where `pre_process`
     (pp 0, vp 0) and the output layer where `post_process` (last pp, last vp) hold, whatever
     stage the letters sit in (`megatron/training/training.py`, `get_model`). A stage with MTP
     also builds the word (and position) embeddings (`GPTModel.__init__`: `if self.pre_process
     or self.mtp_process`); Megatron-LM keeps its word embeddings equal to the first stage's
     through the embedding group (`pretrain_gpt.py`, `get_embedding_ranks`).
   - Megatron-LM keeps the raw string in `args.pipeline_model_parallel_layout` (argparse
     `type=str`); `validate_args` only sets `args.virtual_pipeline_model_parallel_size` to
     stages / PP, or None when that is 1 (`megatron/training/arguments.py`). The string cannot be
     combined with `--decoder-first/last-pipeline-num-layers`, `--account-for-*-in-pipeline-split`
     or `--num-layers-per-virtual-pipeline-stage` (TransformerConfig.__post_init__, validate_args).

2. MindSpeed-LLM's `--num-layer-list` ("1,3,3,1": decoder layers per pipeline rank, summing to
   num_layers), kept as that string in args (`mindspeed_llm/features_manager/pipeline_parallel/
   num_layer_list.py`). Its offsets are prefix sums (`mindspeed_llm/training/arguments.py`,
   `get_layer_offset`); it refuses virtual pipeline stages and is set to None when
   `--noop-layers` is given. `num_layer_list_stages` gives the same stages.

3. MindSpeed's `--noop-layers` ("0,127": 0-based *global* layer ids counted in `--num-layers`),
   turned into a Python `set` of ints in args by `post_validate_args`
   (`mindspeed/features_manager/pipeline_parallel/noop_layers.py`). A noop layer is a
   `NoopTransformerLayer` (`mindspeed/core/pipeline_parallel/noop_layers/adaptor.py`): a module
   with no parameters that keeps its place in `decoder.layers`, so a stage's rank-local keys skip
   its local index (a gap, e.g. only `decoder.layers.1.*` on a stage whose local layer 0 is
   noop). `Stage.real_layers(noop)` is that stage's layers that carry tensors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mcore_proxy.core.errors import ProxyError

SYMBOLS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}

# The two unrolling passes of megatron-core's `parse_str_to_list`, in its order.
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


@dataclass(frozen=True)
class Stage:
    """One (pp, vp) model chunk: its place in the stage order and what it builds.

    decoder: global 0-based decoder layer ids, in order (`decoder.layers.{i}` local index i is
    decoder[i]); mtp: 0-based MTP depths (`mtp.layers.{j}`). embedding / loss: the chunk builds
    the input embedding (pp 0, vp 0) / the final output layer and loss (last pp, last vp).
    symbols: the stage's characters after unrolling, as written.
    """

    pp: int
    vp: int
    index: int
    decoder: tuple[int, ...]
    mtp: tuple[int, ...]
    embedding: bool
    loss: bool
    symbols: str = ""

    @property
    def empty(self) -> bool:
        return not (self.decoder or self.mtp or self.embedding or self.loss)

    def real_layers(self, noop: frozenset[int] | set[int] = frozenset()) -> tuple[tuple[int, int], ...]:
        """(local index, global layer) of the decoder layers that carry tensors (MindSpeed noop
        layers removed; their local indices are gaps)."""
        return tuple((i, g) for i, g in enumerate(self.decoder) if g not in noop)


@dataclass(frozen=True)
class PipelineLayout:
    """Stages of a model over PP ranks x VPP virtual stages, in Megatron's stage order."""

    pp: int
    vpp: int
    stages: tuple[Stage, ...]
    source: str = ""

    def stage(self, pp: int, vp: int = 0) -> Stage:
        if not (0 <= pp < self.pp and 0 <= vp < self.vpp):
            raise IndexError(f"stage (pp={pp}, vp={vp}) outside PP={self.pp} x VPP={self.vpp}")
        return self.stages[vp * self.pp + pp]

    @property
    def num_layers(self) -> int:
        return sum(len(s.decoder) for s in self.stages)

    @property
    def mtp_layers(self) -> int:
        return sum(len(s.mtp) for s in self.stages)

    @property
    def mtp_standalone(self) -> bool:
        """MTP on a pipeline rank other than the last (megatron's `config.mtp_standalone`)."""
        return any(s.mtp and s.pp != self.pp - 1 for s in self.stages)

    def stage_of_layer(self, layer: int) -> tuple[Stage, int]:
        """(stage, local index) holding global decoder layer `layer`."""
        for s in self.stages:
            if layer in s.decoder:
                return s, s.decoder.index(layer)
        raise IndexError(f"decoder layer {layer} is not in this layout ({self.num_layers} layers)")

    @property
    def final_norm_stage(self) -> Stage:
        """The chunk holding `decoder.final_layernorm`: with MTP, megatron-core builds it beside the
        last decoder layer (`TransformerBlock.has_final_layernorm_in_this_stage`), without MTP on
        the post-process (last) chunk."""
        if self.mtp_layers and self.num_layers:
            return self.stage_of_layer(self.num_layers - 1)[0]
        return self.stages[-1]


def unroll(text: str) -> str:
    """The layout string with commas removed and repetitions expanded, as megatron-core does."""
    text = text.replace(",", "")
    for pattern in (_GROUP, _SINGLE):
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    return text


def split_stages(text: str) -> list[str]:
    """Stage strings of a layout in stage order k (no PP needed); bad characters refused."""
    stages = unroll(text).split("|")
    for k, stage in enumerate(stages):
        bad = sorted(set(stage) - set(SYMBOLS))
        if bad:
            raise ProxyError(
                f"pipeline layout {text!r}: stage {k} ({stage!r}) has {bad[0]!r}, not one of "
                f"E (embedding), t (decoder layer), m (MTP layer), L (loss); fix the layout string"
            )
    return stages


def parse_pipeline_layout(
    text: str, pp: int, num_layers: int | None = None, mtp_layers: int | None = None
) -> PipelineLayout:
    """Parse `--pipeline-model-parallel-layout` for `pp` pipeline ranks.

    With `num_layers` (and `mtp_layers`), also apply megatron-core's `validate_layer_layout`
    checks. Raises ProxyError naming the string and what is wrong.
    """
    if pp < 1:
        raise ProxyError(f"pipeline layout {text!r}: pipeline parallel size must be >= 1, got {pp}")
    stages = split_stages(text)
    if len(stages) % pp:
        raise ProxyError(
            f"pipeline layout {text!r} has {len(stages)} stages, not a multiple of "
            f"PP={pp}; give PP x VPP stages separated by '|'"
        )
    vpp = len(stages) // pp
    built, layer, depth = [], 0, 0
    for k, symbols in enumerate(stages):
        n_t, n_m = symbols.count("t"), symbols.count("m")
        pp_rank, vp = k % pp, k // pp
        built.append(
            Stage(
                pp=pp_rank,
                vp=vp,
                index=k,
                decoder=tuple(range(layer, layer + n_t)),
                mtp=tuple(range(depth, depth + n_m)),
                embedding=k == 0,
                loss=k == len(stages) - 1,
                symbols=symbols,
            )
        )
        layer, depth = layer + n_t, depth + n_m
    layout = PipelineLayout(pp=pp, vpp=vpp, stages=tuple(built), source=text)
    if num_layers is not None:
        validate(layout, num_layers, mtp_layers or 0)
    return layout


def validate(layout: PipelineLayout, num_layers: int, mtp_layers: int = 0) -> None:
    """megatron-core's `validate_layer_layout` rules; ProxyError on the first one broken."""
    text = layout.source
    flat = "".join(s.symbols for s in layout.stages)

    def fail(why: str):
        raise ProxyError(f"pipeline layout {text!r}: {why}; fix the layout string")

    if not flat.startswith("E") or flat.count("E") != 1:
        fail("the first symbol must be E and E must appear exactly once")
    if not flat.endswith("L") or flat.count("L") != 1:
        fail("the last symbol must be L and L must appear exactly once")
    if flat.count("t") != num_layers:
        fail(f"it has {flat.count('t')} decoder layers (t), the model has {num_layers}")
    if flat.count("m") != mtp_layers:
        fail(f"it has {flat.count('m')} MTP layers (m), the model has {mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m") :]:
        fail("decoder layers (t) must all come before the MTP layers (m)")
    with_mtp = [s for s in layout.stages if s.mtp]
    if len(with_mtp) > 1:
        fail("all MTP layers (m) must be in one stage")
    if with_mtp and with_mtp[0].vp != layout.vpp - 1:
        fail("MTP layers (m) must be in the last virtual stage of their pipeline rank")


def num_layer_list_stages(
    num_layer_list: str | list[int] | tuple[int, ...], num_layers: int, mtp_layers: int = 0
) -> PipelineLayout:
    """Stages of MindSpeed-LLM's `--num-layer-list` (one entry per PP rank, no VPP); MTP layers,
    as in megatron-core without a layout string, on the last stage."""
    counts = (
        [int(x) for x in num_layer_list.split(",")]
        if isinstance(num_layer_list, str)
        else [int(x) for x in num_layer_list]
    )
    if sum(counts) != num_layers or min(counts) < 0:
        raise ProxyError(
            f"num_layer_list {num_layer_list!r} sums to {sum(counts)}, the model has {num_layers} "
            f"layers; give one non-negative count per pipeline rank"
        )
    layout = chunk_stages(counts, len(counts), mtp_layers)
    return dataclasses.replace(layout, source=str(num_layer_list))


def chunk_stages(counts: list[int] | tuple[int, ...], pp: int, mtp_layers: int = 0) -> PipelineLayout:
    """The stages megatron-core builds without a layout string: `counts` decoder layers per chunk
    in stage order k = vp * PP + pp (first/last stage sizes, or the even interleaved split of
    `--num-layers-per-virtual-pipeline-stage`), the embedding on the first chunk, the MTP layers
    and the loss on the last; `source` is the equivalent layout string."""
    text = "E" + "|".join("t" * c for c in counts) + "m" * mtp_layers + "L"
    return parse_pipeline_layout(text, pp)


def noop_layer_ids(value, num_layers: int) -> frozenset[int]:
    """MindSpeed `--noop-layers` as args hold it (a set of ints after validation, or the raw
    "0,127" string, or None) -> frozenset of 0-based global layer ids below num_layers."""
    if value is None or value == "":
        return frozenset()
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        ids = frozenset(int(x) for x in items)
    except (TypeError, ValueError):
        raise ProxyError(f"noop_layers {value!r}: give comma-separated 0-based layer ids") from None
    if ids and (min(ids) < 0 or max(ids) >= num_layers):
        raise ProxyError(
            f"noop_layers {value!r}: every id must be in 0..{num_layers - 1} "
            f"(0-based global layers counted in num_layers)"
        )
    return ids
