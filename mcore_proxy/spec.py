"""ModelSpec: the architecture facts every stage needs, read from Megatron `args`.

Layer ids are strings: `"L"` for global 0-based decoder layer L (canonical
`decoder.layers.{L}`), `"mtp.k"` for MTP layer k (canonical `mtp.layers.{k}.transformer_layer`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mcore_proxy.errors import CheckpointError


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


def moe_layer_pattern(num_layers: int, moe_layer_freq) -> list[bool]:
    """Megatron's `moe_layer_freq`: int N -> every N-th layer is MoE, list -> 1/0 per layer."""
    if isinstance(moe_layer_freq, int):
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    if isinstance(moe_layer_freq, str):  # MindSpeed/Megatron accept "([0]*3+[1]*58)" strings
        moe_layer_freq = eval(moe_layer_freq, {"__builtins__": {}}, {})  # noqa: S307 - list literal
    pattern = [bool(x) for x in moe_layer_freq]
    if len(pattern) != num_layers:
        raise CheckpointError(f"moe_layer_freq has {len(pattern)} entries, expected num_layers={num_layers}")
    return pattern


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a Megatron GPT MoE model (units: elements, not bytes)."""

    num_layers: int
    hidden_size: int
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]              # global 0-based decoder layers with MoE
    mtp_layers: int = 0                      # MTP layers (each MoE when the decoder is)
    ffn_hidden_size: int | None = None       # dense MLP
    moe_ffn_hidden_size: int | None = None   # routed expert F
    shared_expert_size: int | None = None    # moe_shared_expert_intermediate_size
    score_function: str = "softmax"
    num_groups: int | None = None
    group_topk: int | None = None
    expert_bias: bool = False
    gated_linear_unit: bool = True
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
    def from_args(cls, args) -> "ModelSpec":
        """Build from a Megatron/MindSpeed `args` namespace (attribute access)."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        num_layers = int(get("num_layers"))
        num_experts = get("num_experts") or 0
        pattern = moe_layer_pattern(num_layers, get("moe_layer_freq", 1) or 1) if num_experts else []
        if num_experts and get("first_k_dense_replace"):  # MindSpeed-LLM DeepSeek argument
            k = int(get("first_k_dense_replace"))
            pattern = [i >= k and p for i, p in enumerate(pattern)]
        return cls(
            num_layers=num_layers,
            hidden_size=int(get("hidden_size")),
            num_experts=int(num_experts),
            topk=int(get("moe_router_topk", 2) or 0),
            moe_layers=tuple(i for i, p in enumerate(pattern) if p),
            mtp_layers=int(get("mtp_num_layers") or 0),
            ffn_hidden_size=get("ffn_hidden_size"),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size") or get("ffn_hidden_size"),
            shared_expert_size=get("moe_shared_expert_intermediate_size"),
            score_function=get("moe_router_score_function", "softmax") or "softmax",
            num_groups=get("moe_router_num_groups"),
            group_topk=get("moe_router_group_topk"),
            expert_bias=bool(get("moe_router_enable_expert_bias", False)),
            gated_linear_unit=bool(get("swiglu", False) or get("gated_linear_unit", False)),
        )
