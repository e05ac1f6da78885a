"""MindSpeed-LLM's names for multi-latent attention checkpoints, and the mapping to megatron-core's.

MindSpeed-LLM (Ascend/MindSpeed-LLM, `--ckpt-format torch --transformer-impl local`, its DeepSeek-V3
recipes) saves the same model as megatron-core under other names (docs/families.md 3; sources
`mindspeed_llm/tasks/models/transformer/multi_latent_attention.py`, `tasks/checkpoint/model_builder.py`,
`examples/mcore/deepseek3/convert_ckpt_deepseek3.py`):

  megatron-core (canonical)                          MindSpeed-LLM
  self_attention.linear_q_down_proj [q_lora, H]   \\  self_attention.linear_qkv [q_lora + kv_lora + rope, H]
  self_attention.linear_kv_down_proj [kv_lora+rope, H] / (one `LinearNoTP`: full on every TP rank)
  self_attention.linear_q_up_proj [heads*(qk+rope), q_lora]   linear_q_up_proj (tags <= 2.1.0: linear_qb);
                                                      --mla-mm-split: linear_qk_nope [heads*qk, q_lora]
                                                      and linear_qk_rope [heads*rope, q_lora]
  self_attention.linear_kv_up_proj [heads*(qk+v), kv_lora]    linear_kv_up_proj (<= 2.1.0: linear_kvb);
                                                      --mla-mm-split: linear_kv_nope [heads*qk, kv_lora]
                                                      and linear_v [heads*v, kv_lora]
  mtp.layers.{k}.final_layernorm                      mtp.final_layernorms.{k}
  decoder.final_layernorm (with MTP)                  final_layernorm
  self_attention.core_attention.indexer.              self_attention.dsa_indexer.
    linear_wq_b / linear_wk / k_norm / linear_weights_proj   wq_b / wk / k_norm / weights_proj

The one-to-one renames are rows of `names.NAME_VARIANTS` (readers apply them to every key); this
module adds the two that change tensors (the fused down projection, the `--mla-mm-split` parts) and
the pure functions `megatron_to_mindspeed` / `mindspeed_to_megatron` over whole state dicts of full
(un-sharded) tensors, plus their key-only forms. The split parts are per head: `q_up.view(heads,
qk + rope, q_lora)` split at qk along dim 1 (MindSpeed-LLM views the outputs as [.., heads, qk] and
[.., heads, rope]), so a tensor-parallel shard of whole heads maps to the shards of its parts.
Sharding of the MindSpeed names is in `sharding.py` (layer spec "mindspeed_llm").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from mcore_proxy.checkpoint.interface import NAMINGS
from mcore_proxy.checkpoint.names import apply_variants, canonical_sort_key, restore_variant
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.core.tensors import cat
from mcore_proxy.mcore.megatron_args import arg, arg_int
from mcore_proxy.mcore.sharding import MINDSPEED_SPEC

if TYPE_CHECKING:
    import torch

MEGATRON, MINDSPEED_LLM = NAMINGS

# NAME_VARIANTS ids MindSpeed-LLM's naming uses (names.py); "final_layernorm_top" only with MTP
_RENAME_VARIANTS = ("mtp_final_layernorms", "dsa_indexer")
_OLD_UP_VARIANTS = ("linear_qb", "linear_kvb")

_ATTN = r"^(?P<p>.*)\.self_attention\."
_FUSED = re.compile(_ATTN + r"linear_qkv\.weight$")
_DOWN = re.compile(_ATTN + r"linear_(?P<w>q|kv)_down_proj\.weight$")
_UP = re.compile(_ATTN + r"linear_(?P<w>q|kv)_up_proj\.weight$")
_SPLIT = re.compile(_ATTN + r"linear_(?P<w>qk_nope|qk_rope|kv_nope|v)\.weight$")
# split part -> (up projection, position of the part)
_PARTS = {"qk_nope": ("q", 0), "qk_rope": ("q", 1), "kv_nope": ("kv", 0), "v": ("kv", 1)}
_PART_NAMES = {"q": ("qk_nope", "qk_rope"), "kv": ("kv_nope", "v")}
# keys only MindSpeed-LLM's MLA saves (a `linear_qkv` is GQA's too: see `detect_naming`)
MINDSPEED_ONLY = re.compile(
    r"\.self_attention\.(linear_qb|linear_kvb|linear_qk_nope|linear_qk_rope|linear_kv_nope"
    r"|linear_v|dsa_indexer\.[a-z_]+)\.weight$|^mtp\.final_layernorms\.\d+\.weight$"
)
_MLA_ONLY = re.compile(
    r"\.self_attention\.(kv_layernorm\.weight|linear_kv_up_proj\.weight|linear_kvb\.weight"
    r"|linear_kv_nope\.weight)$"
)


@dataclass(frozen=True)
class MindSpeedNaming:
    """How a MindSpeed-LLM checkpoint spells multi-latent attention.

    mla_mm_split: `--mla-mm-split` (up projections stored as four per-head parts);
    old_up_names: `linear_qb` / `linear_kvb` (MindSpeed-LLM tags up to 2.1.0);
    mtp: the model has MTP layers (the main final norm is then the top-level `final_layernorm`).
    """

    mla_mm_split: bool = False
    old_up_names: bool = False
    mtp: bool = False

    def megatron_info(self, info):
        """The ViewInfo `info` of a source in this naming as megatron-core names it."""
        return dataclasses.replace(info, naming=None, variants=info.variants - self.variants())

    def variants(self) -> frozenset[str]:
        """The NAME_VARIANTS spellings this naming uses."""
        out = set(_RENAME_VARIANTS)
        if self.old_up_names:
            out |= set(_OLD_UP_VARIANTS)
        if self.mtp:
            out.add("final_layernorm_top")
        return frozenset(out)

    def describe(self) -> str:
        opts = [
            o for o, on in (("--mla-mm-split", self.mla_mm_split), ("linear_qb/linear_kvb", self.old_up_names)) if on
        ]
        return "MindSpeed-LLM" + (f" ({', '.join(opts)})" if opts else "")


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention sizes (args): heads, q_lora, kv_lora, qk (nope), rope, v head dims."""

    heads: int
    q_lora: int
    kv_lora: int
    qk: int
    rope: int
    v: int

    @classmethod
    def from_args(cls, args, where: str = "args") -> "MLADims":
        values = {
            f: arg_int(args, a, where)
            for f, a in (
                ("heads", "num_attention_heads"),
                ("q_lora", "q_lora_rank"),
                ("kv_lora", "kv_lora_rank"),
                ("qk", "qk_head_dim"),
                ("rope", "qk_pos_emb_head_dim"),
                ("v", "v_head_dim"),
            )
        }
        missing = [f for f, v in values.items() if not v]
        if missing:
            raise CheckpointError(
                f"{where}: MindSpeed-LLM's multi-latent attention names need args "
                f"{missing} (q_lora_rank None is not mapped); fix the args"
            )
        return cls(**values)

    def part_sizes(self, which: str) -> tuple[int, int]:
        """Per-head rows of the two parts of the q (nope, rope) or kv (nope, v) up projection."""
        return (self.qk, self.rope) if which == "q" else (self.qk, self.v)


# -- keys ------------------------------------------------------------------------------------------


def mindspeed_keys(name: str, naming: MindSpeedNaming) -> tuple[str, ...]:
    """Megatron canonical name -> the MindSpeed-LLM key(s) holding its values (before the
    one-to-one NAME_VARIANTS renames, `names.restore_variant`). Both down projections give the same
    fused key; an up projection gives its two parts under --mla-mm-split."""
    if m := _DOWN.match(name):
        return (f"{m['p']}.self_attention.linear_qkv.weight",)
    if naming.mla_mm_split and _UP.match(name):
        return split_parts(name)
    return (name,)


def megatron_keys(key: str) -> tuple[str, ...]:
    """MindSpeed-LLM key (after the NAME_VARIANTS renames) -> the megatron canonical name(s) it
    holds values of: the fused `linear_qkv` gives both down projections. Call it for MLA layers only
    (GQA's `linear_qkv` is the same key and stays)."""
    if m := _FUSED.match(key):
        return tuple(f"{m['p']}.self_attention.linear_{w}_down_proj.weight" for w in ("q", "kv"))
    if m := _SPLIT.match(key):
        return (f"{m['p']}.self_attention.linear_{_PARTS[m['w']][0]}_up_proj.weight",)
    return (key,)


def split_parts(up_name: str) -> tuple[str, str]:
    """Megatron up-projection name -> the keys of its two --mla-mm-split parts, in order."""
    m = _UP.match(up_name)
    return tuple(f"{m['p']}.self_attention.linear_{part}.weight" for part in _PART_NAMES[m["w"]])


def megatron_to_mindspeed_key(name: str, naming: MindSpeedNaming) -> tuple[str, ...]:
    """Megatron canonical name -> MindSpeed-LLM key(s) as saved (all renames applied)."""
    return tuple(restore_variant(k, naming.variants()) for k in mindspeed_keys(name, naming))


def mindspeed_to_megatron_key(key: str, mla: bool = True) -> tuple[str, ...]:
    """MindSpeed-LLM key as saved -> megatron canonical name(s); `mla`: the layer is
    multi-latent attention (decides the fused `linear_qkv`)."""
    key = apply_variants(key)[0]
    return megatron_keys(key) if mla else (key,)


# -- tensors (full, un-sharded; shards of whole heads for the split parts) ----------------------------


def fuse_down(q_down: torch.Tensor, kv_down: torch.Tensor) -> torch.Tensor:
    """[q_lora, H], [kv_lora + rope, H] -> MindSpeed-LLM's `linear_qkv` [q_lora + kv_lora + rope, H]."""
    return cat([q_down, kv_down])


def unfuse_down(fused: torch.Tensor, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_qkv` [q_lora + kv_lora + rope, H] -> (q_down [q_lora, H], kv_down [kv_lora + rope, H])."""
    if fused.shape[0] != dims.q_lora + dims.kv_lora + dims.rope:
        raise CheckpointError(
            f"fused linear_qkv has {fused.shape[0]} rows, expected q_lora + kv_lora + rope = "
            f"{dims.q_lora + dims.kv_lora + dims.rope}"
        )
    return fused[: dims.q_lora], fused[dims.q_lora :]


def split_up(up: torch.Tensor, which: str, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """Up projection [h*(a+b), r] of h whole heads -> its --mla-mm-split parts [h*a, r], [h*b, r]."""
    a, b = dims.part_sizes(which)
    per_head = up.reshape(-1, a + b, up.shape[-1])
    return per_head[:, :a].reshape(-1, up.shape[-1]), per_head[:, a:].reshape(-1, up.shape[-1])


def join_up(first: torch.Tensor, second: torch.Tensor, which: str, dims: MLADims) -> torch.Tensor:
    """The inverse of `split_up`: parts of the same whole heads -> [h*(a+b), r]."""
    a, b = dims.part_sizes(which)
    r = first.shape[-1]
    if first.shape[0] % a or second.shape[0] % b or first.shape[0] // a != second.shape[0] // b:
        raise CheckpointError(
            f"--mla-mm-split parts of shapes {list(first.shape)} and {list(second.shape)} do not "
            f"hold the same heads of {a} + {b} rows"
        )
    return cat([first.reshape(-1, a, r), second.reshape(-1, b, r)], dim=1).reshape(-1, r)


def megatron_to_mindspeed(state: Mapping[str, object], naming: MindSpeedNaming, dims: MLADims) -> dict:
    """A state dict of megatron canonical names (full tensors of MLA layers) -> MindSpeed-LLM's keys
    and tensors as saved. Pure: the input is not changed; tensors not renamed are the same objects."""
    out: dict = {}
    for name, value in state.items():
        keys = megatron_to_mindspeed_key(name, naming)
        if (m := _DOWN.match(name)) is not None:
            if m["w"] == "q":
                other = f"{m['p']}.self_attention.linear_kv_down_proj.weight"
                out[keys[0]] = fuse_down(value, state[other])
        elif len(keys) == 2:
            for key, part in zip(keys, split_up(value, _UP.match(name)["w"], dims)):
                out[key] = part
        else:
            out[keys[0]] = value
    return out


def mindspeed_to_megatron(state: Mapping[str, object], dims: MLADims) -> dict:
    """The inverse of `megatron_to_mindspeed` for a state dict of an MLA model (every `linear_qkv` is
    the fused down projection)."""
    renamed = {apply_variants(k)[0]: v for k, v in state.items()}
    out: dict = {}
    for key, value in renamed.items():
        if m := _FUSED.match(key):
            q, kv = megatron_keys(key)
            out[q], out[kv] = unfuse_down(value, dims)
        elif m := _SPLIT.match(key):
            which, pos = _PARTS[m["w"]]
            if pos == 0:
                second = renamed[f"{m['p']}.self_attention.linear_{_PART_NAMES[which][1]}.weight"]
                out[megatron_keys(key)[0]] = join_up(value, second, which, dims)
        else:
            out[key] = value
    return out


# -- detection -------------------------------------------------------------------------------------


def detect_naming(args, keys, where: str = "args") -> MindSpeedNaming | None:
    """MindSpeed-LLM's naming of multi-latent attention if `keys` (rank-local or global, as saved)
    show it, else None. Multi-latent attention is read from `args.multi_latent_attention`, or, when
    the args are silent, from MLA-only keys (`kv_layernorm`, kv up projections) beside a
    `linear_qkv`: a `linear_qkv` in an MLA layer is the fused down projection, in any other layer
    GQA's column-parallel projection. `mla_mm_split` from args, or from the split parts' names."""
    keys = list(keys)
    mla = bool(arg(args, "multi_latent_attention")) or any(_MLA_ONLY.search(k) for k in keys)
    if not mla:
        return None
    has = lambda regex: any(regex.search(k) for k in keys)  # noqa: E731
    fused = has(re.compile(r"\.self_attention\.linear_qkv\.weight$"))
    if not fused and not has(MINDSPEED_ONLY):
        return None
    split = has(re.compile(r"\.self_attention\.linear_qk_nope\.weight$"))
    if arg(args, "mla_mm_split") is not None and bool(arg(args, "mla_mm_split")) != split:
        raise CheckpointError(
            f"{where}: args mla_mm_split is {arg(args, 'mla_mm_split')!r} but the tensors are "
            f"{'' if split else 'not '}split into linear_qk_nope/linear_qk_rope; fix the args"
        )
    return MindSpeedNaming(
        mla_mm_split=split,
        old_up_names=has(re.compile(r"\.self_attention\.linear_(qb|kvb)\.weight$")),
        mtp=bool(arg_int(args, "mtp_num_layers")),
    )


# -- writing: a canonical view seen under MindSpeed-LLM's names --------------------------------------


def written_naming(view, naming: str | None):
    """The naming the legacy writer writes `view` in: `naming` ("megatron" / "mindspeed-llm",
    already checked by `Writer.refuse_options`), or by default the source's. Returns a
    MindSpeedNaming or None (megatron-core names)."""
    from mcore_proxy.checkpoint.layer_spec import attention_kind
    from mcore_proxy.core.errors import ProxyError

    source = view.info.naming
    if naming is None:
        return source
    if naming == MEGATRON:
        return None
    if view.args is not None and arg(view.args, "experimental_attention_variant") == "dsv4_hybrid":
        from mcore_proxy.checkpoint.mindspeed_llm_v4 import MindSpeedV4Naming

        return MindSpeedV4Naming(mtp=bool(arg_int(view.args, "mtp_num_layers")))
    if view.args is None or attention_kind(view.args) != "mla":
        raise ProxyError(
            f"--naming {MINDSPEED_LLM} maps multi-latent attention names; this checkpoint has "
            "grouped-query attention, whose names MindSpeed-LLM shares with megatron-core: drop --naming"
        )
    return source or MindSpeedNaming(mtp=bool(arg_int(view.args, "mtp_num_layers")))


class MindSpeedNamedView(ModelView):
    """A view with megatron canonical names seen under MindSpeed-LLM's names, for writers: the fused
    `linear_qkv` and the --mla-mm-split parts replace the down and up projections (full tensors,
    global layers); the one-to-one renames are left to the writer (`info.variants`); layer spec
    "mindspeed_llm" (its sharding rows)."""

    def __init__(self, view: ModelView, naming: MindSpeedNaming):
        super().__init__(
            dataclasses.replace(
                view.info, naming=naming, layer_spec=MINDSPEED_SPEC, variants=view.info.variants | naming.variants()
            )
        )
        self.source, self.dims = view, MLADims.from_args(view.args)
        self._sources: dict[str, tuple[str, ...]] = {}
        for name in view.names():
            for key in mindspeed_keys(name, naming):
                # the fused key's sources in its row order (q, then kv), whatever the names' order
                self._sources[key] = megatron_keys(key) if _FUSED.match(key) else (name,)
        self._names = sorted(self._sources, key=canonical_sort_key)
        self._last: tuple[str, torch.Tensor] | None = None  # the up projection both its parts read

    def names(self) -> list[str]:
        return list(self._names)

    def _part(self, key: str) -> tuple[str, int] | None:
        """(which up projection, position) of an --mla-mm-split part, None for other keys."""
        src = self._sources[key]
        return _PARTS[_SPLIT.match(key)["w"]] if len(src) == 1 and src[0] != key else None

    def get(self, key: str):
        src = self._sources[key]
        if len(src) == 2:
            return fuse_down(self.source.get(src[0]), self.source.get(src[1]))
        if part := self._part(key):
            if self._last is None or self._last[0] != src[0]:
                self._last = (src[0], self.source.get(src[0]))
            return split_up(self._last[1], part[0], self.dims)[part[1]].contiguous()
        return self.source.get(key)

    def shape(self, key: str):
        src = self._sources[key]
        if len(src) == 2:
            a, b = self.source.shape(src[0]), self.source.shape(src[1])
            return (a[0] + b[0], a[1])
        if part := self._part(key):
            up, sizes = self.source.shape(src[0]), self.dims.part_sizes(part[0])
            return (up[0] // sum(sizes) * sizes[part[1]], up[1])
        return self.source.shape(key)

    def dtype(self, key: str):
        return self.source.dtype(self._sources[key][0])

    def dtype_name(self, key: str):
        return self.source.dtype_name(self._sources[key][0])

    def prefetch(self, names: list[str]) -> None:
        self.source.prefetch([n for k in names for n in self._sources.get(k, ())])


class MegatronNamedView(ModelView):
    """A MindSpeed-LLM source (read under megatron names) to be written with megatron-core's names:
    the same tensors without MindSpeed-LLM's one-to-one renames (`info.variants`)."""

    def __init__(self, view: ModelView):
        super().__init__(view.info.naming.megatron_info(view.info))
        self.source = view

    def names(self) -> list[str]:
        return self.source.names()

    def get(self, name: str):
        return self.source.get(name)

    def shape(self, name: str):
        return self.source.shape(name)

    def dtype(self, name: str):
        return self.source.dtype(name)

    def dtype_name(self, name: str):
        return self.source.dtype_name(name)

    def prefetch(self, names: list[str]) -> None:
        self.source.prefetch(names)


def naming_args(args, target):
    """Written `args` whose MindSpeed-LLM flags (`mla_mm_split`, `moe_tp_extend_ep`) describe the
    files of `target` (a ParallelLayout): a reader of the output must not place experts or split
    projections by the source's flags. Fields the source lacks stay absent when off."""
    if target.naming is not None or getattr(args, "mla_mm_split", None) is not None:
        args.mla_mm_split = bool(target.naming is not None and target.naming.mla_mm_split)
    if target.tp_extend_ep or getattr(args, "moe_tp_extend_ep", None) is not None:
        args.moe_tp_extend_ep = target.tp_extend_ep
    return args


def has_extra_state(key: str, naming: MindSpeedNaming | None) -> bool:
    """Whether a linear weight `key` has an `_extra_state` entry beside it: MindSpeed-LLM's fused
    `linear_qkv` is a `LinearNoTP` (a torch.nn.Linear), which has none."""
    return naming is None or not _FUSED.match(key)
