"""ModelSpec: the one description of a model's structure, read once from Megatron `args`.

Every stage asks the ModelSpec: selection (routing), convert and the writers (layers, experts),
`estimate` (sizes, attention), `verify --functional`, `distill` and the functional runs (what
megatron-core builds: attention, positions, norms, embeddings, activation). `ModelSpec.from_args`
is the only reader of Megatron/MindSpeed args for model structure outside the formats; the HF
format builds its ModelSpec from args it derives from config.json. Structure fields the args do
not hold are None, and `require` names them when a stage needs them. The token mixers megatron-core
0.16 args do not describe (DeepSeek-V3.2's indexer, Gated DeltaNet, DeepSeek-V4's attention, mHC)
are filled from config.json by the HF format (`checkpoint.hf.spec_fields_from_config`) for `estimate`.

Layer ids are strings: `"L"` for global 0-based decoder layer L (canonical
`decoder.layers.{L}`), `"mtp.k"` for MTP layer k (canonical `mtp.layers.{k}.transformer_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.layer_pattern import MAX_LAYERS, parse_layer_pattern
from mcore_proxy.mcore import megatron_args as ma
from mcore_proxy.mcore.megatron_args import DEFAULTS, arg, arg_bool, arg_int, arg_str
from mcore_proxy.mcore.pipeline_layout import noop_layer_ids


# The largest size or count taken from any source (2^31 - 1): far beyond any model's width, expert
# count or vocabulary, and small enough that products of a few of them stay exact in float64-based
# reports and in int64 tensors.
MAX_SIZE = 2**31 - 1
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


def homogeneous_layers(args) -> bool:
    """Whether megatron's TransformerBlock stacks layers on one axis (its `non_homogeneous_layers`
    test): no `moe_layer_freq` / `linear_attention_freq` list or int > 1, no heterogeneous specs,
    not DeepSeek-V4's hybrid attention (Megatron-LM dev sets `hetereogenous_dist_checkpoint` for it)."""
    if arg(args, "experimental_attention_variant") == "dsv4_hybrid" or arg(args, "hetereogenous_dist_checkpoint"):
        return False
    for attr in ("moe_layer_freq", "linear_attention_freq"):
        # MindSpeed/Megatron accept "([0]*3+[1]*58)" strings: the safe parser, never eval
        value = parse_layer_pattern(arg(args, attr), f"args {attr}")
        if isinstance(value, list) or (isinstance(value, int) and value > 1):
            return False
    if arg(args, "heterogeneous_layers_config_path") or arg(args, "heterogeneous_layers_config_encoded_json"):
        return False
    return True


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention sizes (Megatron argument names; DeepSeek's config names in brackets)."""

    q_lora_rank: int | None  # [q_lora_rank]; None: no query compression (linear_q_proj)
    kv_lora_rank: int  # [kv_lora_rank]
    qk_head_dim: int  # [qk_nope_head_dim]
    qk_pos_emb_head_dim: int  # [qk_rope_head_dim]
    v_head_dim: int  # [v_head_dim]


@dataclass(frozen=True)
class Indexer:
    """DeepSeek-V3.2's sparse-attention indexer in every layer: wq_b, wk, k_norm, weights_proj
    (Megatron: `experimental_attention_variant` "dsa", `dsa_indexer_*`)."""

    n_heads: int  # [index_n_heads]
    head_dim: int  # [index_head_dim]
    topk: int | None = None  # [index_topk]: tokens each query attends to (building only; not a size)


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (transformers' config names in brackets): in_proj of q, k, v, the output
    gate z and the per-head beta and alpha, a depthwise causal conv over q, k, v, per-head
    dt_bias and A_log, a gated RMSNorm over the value head dim, out_proj."""

    num_key_heads: int  # [linear_num_key_heads]
    num_value_heads: int  # [linear_num_value_heads]
    key_head_dim: int  # [linear_key_head_dim]
    value_head_dim: int  # [linear_value_head_dim]
    conv_kernel: int  # [linear_conv_kernel_dim]


@dataclass(frozen=True)
class V4Attention:
    """DeepSeek-V4's attention: q through a low-rank q_lora_rank (wq_a, q_norm, wq_b), one shared
    key/value head of head_dim (wkv, kv_norm), heads in o_groups groups each projected to
    o_lora_rank (wo_a) and mixed to the hidden size (wo_b), per-head sinks. A layer of compress
    ratio r > 0 adds a KV compressor (wkv, wgate of c*head_dim with c = 2 when r = 4, whose windows
    overlap, else 1; ape [r, c*head_dim]; norm), and r = 4 (compressed sparse attention) a
    lightning indexer (its own compressor at index_head_dim, wq_b, weights_proj)."""

    head_dim: int  # [head_dim]
    q_lora_rank: int  # [q_lora_rank]
    o_groups: int  # [o_groups]
    o_lora_rank: int  # [o_lora_rank]
    index_n_heads: int  # [index_n_heads]
    index_head_dim: int  # [index_head_dim]
    compress_ratios: tuple[int, ...]  # [compress_ratios]: per decoder layer, then per MTP layer


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
    # megatron-core stacks the decoder layers on one torch_dist axis (`homogeneous_layers`); a
    # moe_layer_freq list makes them per-layer even when it is all ones. How they are keyed, not
    # what they compute: not compared
    stacked_layers: bool = field(default=True, compare=False)
    # MindSpeed --noop-layers: 0-based global layers counted in num_layers that hold no tensors
    # (pipeline_layout.py point 3); never in moe_layers
    noop_layers: tuple[int, ...] = ()
    # routing beyond the top-k
    shared_expert_gate: bool = False
    topk_scaling_factor: float | None = None  # None: routing weights are not scaled
    pre_softmax: bool = False  # softmax over all experts, then top-k (no renormalisation)
    # what building the model in megatron-core needs beyond routing; None where the args lack a
    # size (`require` names it)
    num_attention_heads: int | None = None
    num_query_groups: int | None = None  # key/value heads as megatron-core runs the model
    kv_channels: int | None = None  # the GQA/MHA head dim
    mla: MLA | None = None
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = False
    normalization: str = "RMSNorm"  # or "LayerNorm" (weight and bias)
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    activation: str = "swiglu"  # one of megatron_args.ACTIVATIONS
    vocab_size: int | None = None  # the embedding's rows (padded_vocab_size)
    seq_length: int | None = None
    # token mixers and residuals beyond GQA and MLA (what `estimate` counts; HF config.json names
    # them, Megatron args of megatron-core 0.16 do not)
    indexer: Indexer | None = None  # DeepSeek-V3.2's sparse-attention indexer in every layer
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()  # 0-based decoder layers with linear attention (MTP: full)
    attention_output_gate: bool = False  # gated attention: q_proj also yields a per-channel gate
    attention_sinks: bool = False  # a learnable softmax sink per head
    v4_attention: V4Attention | None = None
    hyper_connections: int = 0  # mHC residual streams (hc_mult); 0: a plain residual
    hash_layers: tuple[int, ...] = ()  # 0-based MoE decoder layers routed by a [vocab, top-k] token-id table
    # what the args say of tying (None: nothing; then the tensors decide, `ModelView.embeddings_tied`):
    # not compared, since the writers state it and a copy of a model is the same model
    untie_embeddings: bool | None = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    source: str | None = field(default=None, compare=False, repr=False)  # the file the args come from
    name: str = field(default="", compare=False, repr=False)  # what a report calls the model

    def __post_init__(self):
        if self.num_experts and not 0 < self.topk <= self.num_experts:
            raise CheckpointError(f"top-k {self.topk} is not in 1..num_experts={self.num_experts}")

    @property
    def mtp_is_moe(self) -> bool:
        """Megatron builds MTP layers with the spec of the last decoder layer (Megatron-LM's
        gpt_builders); MindSpeed's noop layers hold no tensors, so the last one that does."""
        real = [L for L in range(self.num_layers) if L not in self.noop_layers]
        return bool(real) and real[-1] in self.moe_layers

    @property
    def moe_layer_ids(self) -> list[str]:
        """Every MoE layer id, decoder layers first, then MTP layers (when `mtp_is_moe`)."""
        mtp = [f"mtp.{k}" for k in range(self.mtp_layers)] if self.mtp_is_moe else []
        return [str(L) for L in self.moe_layers] + mtp

    @property
    def hash_layer_ids(self) -> list[str]:
        """The layer ids of the hash-routed MoE layers (decoder layers only)."""
        return [str(L) for L in self.hash_layers]

    @property
    def dense_ffn_hidden_size(self) -> int:
        """The dense MLP width megatron-core builds: the saved size, else Megatron's own rule."""
        return self.ffn_hidden_size or ma.default_ffn_hidden_size(self.hidden_size, self.activation == "swiglu")

    def require(self, *names: str, needed: str):
        """The fields `names`, or one sentence naming the first one the args lacked and the file."""
        for name in names:
            if getattr(self, name) is None:
                raise ma.lacking(name, self.source, needed)
        return tuple(getattr(self, name) for name in names)

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
            shared_expert_size=_shared_expert_size(args, where),
            score_function=arg_str(args, "moe_router_score_function", where) or "softmax",
            # MindSpeed-LLM's DeepSeek spellings where Megatron's are absent
            num_groups=_first_int(args, ("moe_router_num_groups", "n_group"), where),
            group_topk=_first_int(args, ("moe_router_group_topk", "topk_group"), where),
            expert_bias=arg_bool(args, "moe_router_enable_expert_bias", where),
            noop_layers=tuple(sorted(noop)),
            shared_expert_gate=arg_bool(args, "moe_shared_expert_gate", where),
            topk_scaling_factor=ma.arg_float(args, "moe_router_topk_scaling_factor", where),
            pre_softmax=arg_bool(args, "moe_router_pre_softmax", where),
            hash_layers=tuple(i for i in range(min(hashed, len(pattern))) if pattern[i]),
            stacked_layers=homogeneous_layers(args),
            source=where,
            **_build_facts(args, where),
        )


def _present(args, name: str) -> bool:
    return args is not None and getattr(args, name, None) is not None


def _size(args, name: str, where: str | None) -> int | None:
    """A size the args may lack (no safe default): a positive integer, or None where absent."""
    return arg_int(args, name, where, minimum=1) if _present(args, name) else None


def _first_int(args, names: tuple[str, ...], where: str | None) -> int | None:
    """The first of `names` the args hold a non-zero integer for (None: none of them)."""
    return next((v for n in names if (v := arg_int(args, n, where))), None)


def _shared_expert_size(args, where: str | None) -> int | None:
    """All shared experts' width: Megatron's moe_shared_expert_intermediate_size, else MindSpeed-LLM's
    --n-shared-experts times the routed experts' width."""
    size = arg_int(args, "moe_shared_expert_intermediate_size", where)
    if size:
        return size
    n = arg_int(args, "n_shared_experts", where)
    width = _first_int(args, ("moe_ffn_hidden_size", "moe_intermediate_size"), where)
    return n * width if n and width else None


def _build_facts(args, where: str | None) -> dict:
    """What megatron-core builds beyond routing: attention, positions, norms, embeddings. A size
    without a safe default that the args lack is None (routing-only stages never need it)."""
    heads = _size(args, "num_attention_heads", where)
    # MindSpeed-LLM spells the MLA switch and two of its head dims its own way
    mla = arg_bool(args, "multi_latent_attention", where) or arg_bool(args, "multi_head_latent_attention", where)
    facts = dict(
        num_attention_heads=heads,
        qk_layernorm=arg_bool(args, "qk_layernorm", where),
        add_qkv_bias=arg_bool(args, "add_qkv_bias", where),
        add_bias_linear=arg_bool(args, "add_bias_linear", where),
        normalization=arg_str(args, "normalization", where),
        norm_epsilon=ma.norm_epsilon(args, where),
        position_embedding_type=arg_str(args, "position_embedding_type", where),
        rotary_base=ma.arg_float(args, "rotary_base", where),
        rotary_percent=ma.arg_float(args, "rotary_percent", where),
        activation=ma.activation_of_args(args, where),
        vocab_size=_size(args, "padded_vocab_size", where) or _size(args, "vocab_size", where),
        seq_length=_size(args, "seq_length", where),
        untie_embeddings=(
            arg_bool(args, "untie_embeddings_and_output_weights", where)
            if _present(args, "untie_embeddings_and_output_weights")
            else None
        ),
    )
    if mla:
        spelled = lambda name, mindspeed: name if _present(args, name) or not _present(args, mindspeed) else mindspeed  # noqa: E731
        facts["mla"] = MLA(
            q_lora_rank=arg_int(args, "q_lora_rank", where, minimum=1),
            kv_lora_rank=arg_int(args, "kv_lora_rank", where, minimum=1),
            qk_head_dim=arg_int(args, spelled("qk_head_dim", "qk_nope_head_dim"), where, minimum=1),
            qk_pos_emb_head_dim=arg_int(args, spelled("qk_pos_emb_head_dim", "qk_rope_head_dim"), where, minimum=1),
            v_head_dim=arg_int(args, "v_head_dim", where, minimum=1),
        )
    elif heads is not None:
        facts.update(num_query_groups=ma.num_query_groups(args, where), kv_channels=ma.kv_channels(args, where))
    if arg_str(args, "experimental_attention_variant", where) == "dsa":
        facts["indexer"] = Indexer(
            n_heads=arg_int(args, "dsa_indexer_n_heads", where, minimum=1),
            head_dim=arg_int(args, "dsa_indexer_head_dim", where, minimum=1),
            topk=arg_int(args, "dsa_indexer_topk", where, minimum=1),
        )
    return facts
