"""ModelSpec: the architecture facts every stage needs, read from Megatron `args`.

Layer ids are strings: `"L"` for global 0-based decoder layer L (canonical
`decoder.layers.{L}`), `"mtp.k"` for MTP layer k (canonical `mtp.layers.{k}.transformer_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.layer_pattern import MAX_LAYERS, parse_layer_pattern
from mcore_proxy.mcore.megatron_args import DEFAULTS, arg, arg_bool, arg_int, arg_str
from mcore_proxy.mcore.pipeline_layout import noop_layer_ids


MAX_EXPERTS = 1 << 16  # routed experts per layer: far above any real model, bounds per-expert tables


def layer_module_prefix(layer_id: str) -> str:
    """Canonical module prefix of a layer id: `"3"` -> `decoder.layers.3`."""
    if layer_id.startswith("mtp."):
        return f"mtp.layers.{layer_id.split('.')[1]}.transformer_layer"
    return f"decoder.layers.{int(layer_id)}"


def router_weight_name(layer_id: str) -> str:
    """Canonical name of a MoE layer's router weight, [E, H]."""
    return f"{layer_module_prefix(layer_id)}.mlp.router.weight"


def expert_bias_name(layer_id: str) -> str:
    """Canonical name of a MoE layer's aux-free expert bias, [E] fp32."""
    return f"{layer_module_prefix(layer_id)}.mlp.router.expert_bias"


def moe_layer_pattern(num_layers: int, moe_layer_freq, where: str | None = None) -> list[bool]:
    """Megatron's `moe_layer_freq`: int N -> every N-th layer is MoE, list -> 1/0 per layer.

    Strings (`"[0]*3+[1]*58"`, as MindSpeed and Megatron accept) go through the safe parser in
    `layer_pattern`, never through eval."""
    what = "args moe_layer_freq" + (f" in {where}" if where else "")
    freq = parse_layer_pattern(moe_layer_freq, what)
    if isinstance(freq, int):
        if freq < 1:
            raise CheckpointError(f"{what} is {freq}, expected a frequency >= 1 or a list; fix the args")
        return [i % freq == 0 for i in range(num_layers)]
    pattern = [bool(x) for x in freq]
    if len(pattern) != num_layers:
        raise CheckpointError(f"{what} has {len(pattern)} entries, expected num_layers={num_layers}; fix the args")
    return pattern


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a Megatron GPT MoE model (units: elements, not bytes)."""

    num_layers: int
    hidden_size: int
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]  # global 0-based decoder layers with MoE
    mtp_layers: int = 0  # MTP layers (each MoE when the decoder is)
    ffn_hidden_size: int | None = None  # dense MLP
    moe_ffn_hidden_size: int | None = None  # routed expert F
    shared_expert_size: int | None = None  # moe_shared_expert_intermediate_size
    score_function: str = "softmax"
    num_groups: int | None = None
    group_topk: int | None = None
    expert_bias: bool = False
    gated_linear_unit: bool = True
    # MindSpeed --noop-layers: 0-based global layers counted in num_layers that hold no tensors
    # (pipeline_layout.py point 3); never in moe_layers
    noop_layers: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_experts and not 0 < self.topk <= self.num_experts:
            raise CheckpointError(f"top-k {self.topk} is not in 1..num_experts={self.num_experts}")

    @property
    def moe_layer_ids(self) -> list[str]:
        """Every MoE layer id, decoder layers first, then MTP layers."""
        mtp = [f"mtp.{k}" for k in range(self.mtp_layers)] if self.moe_layers else []
        return [str(L) for L in self.moe_layers] + mtp

    @classmethod
    def from_args(cls, args, where: str | None = None) -> "ModelSpec":
        """Build from a Megatron/MindSpeed `args` namespace (attribute access).

        Absent fields take Megatron's defaults (`megatron_args.DEFAULTS`); `where` (the file the
        args come from) is named in every message about them."""
        num_layers = arg_int(args, "num_layers", where, minimum=1, maximum=MAX_LAYERS)
        num_experts = arg_int(args, "num_experts", where, maximum=MAX_EXPERTS) or 0
        freq = arg(args, "moe_layer_freq", where)
        pattern = moe_layer_pattern(num_layers, 1 if freq is None else freq, where) if num_experts else []
        # MindSpeed-LLM DeepSeek argument; its DeepSeek-V4 recipe says -1 (no dense layer)
        first_dense = arg_int(args, "first_k_dense_replace", where, minimum=-1)
        if num_experts and first_dense:
            pattern = [i >= first_dense and p for i, p in enumerate(pattern)]
        try:
            noop = noop_layer_ids(arg(args, "noop_layers", where), num_layers)
        except ProxyError as err:
            raise CheckpointError(f"args{' of ' + where if where else ''}: {err}") from None
        pattern = [p and i not in noop for i, p in enumerate(pattern)]
        ffn = arg_int(args, "ffn_hidden_size", where, minimum=1)
        topk = arg_int(args, "moe_router_topk", where)
        # Megatron-LM's DeepSeek-V4 (`moe_n_hash_layers`; MindSpeed-LLM `n_hash_layers`): the first n
        # decoder layers route by a token-id table (`mlp.router.tid2eid`), MTP layers never
        hashed = (
            arg_int(args, "moe_n_hash_layers", where, maximum=num_layers)
            or arg_int(args, "n_hash_layers", where, maximum=num_layers)
            or 0
        )
        return cls(
            num_layers=num_layers,
            hidden_size=arg_int(args, "hidden_size", where, minimum=1),
            num_experts=num_experts,
            topk=DEFAULTS["moe_router_topk"] if topk is None else topk,
            moe_layers=tuple(i for i, p in enumerate(pattern) if p),
            mtp_layers=arg_int(args, "mtp_num_layers", where, maximum=MAX_LAYERS) or 0,
            ffn_hidden_size=ffn,
            moe_ffn_hidden_size=arg_int(args, "moe_ffn_hidden_size", where, minimum=1) or ffn,
            shared_expert_size=arg_int(args, "moe_shared_expert_intermediate_size", where) or None,
            score_function=arg_str(args, "moe_router_score_function", where) or "softmax",
            num_groups=arg_int(args, "moe_router_num_groups", where) or None,
            group_topk=arg_int(args, "moe_router_group_topk", where) or None,
            expert_bias=arg_bool(args, "moe_router_enable_expert_bias", where),
            gated_linear_unit=arg_bool(args, "swiglu", where) or arg_bool(args, "gated_linear_unit", where),
            noop_layers=tuple(sorted(noop)),
            extra={"hash_layers": [str(i) for i in range(min(hashed, len(pattern))) if pattern[i]]} if hashed else {},
        )
