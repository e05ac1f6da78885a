"""A small Megatron MoE GPT described by its args, built by megatron-core on CPU.

`ToyMoE` holds the architecture (what `megatron_args` writes as a checkpoint's args and
`transformer_config` builds; `functional.family.family_from_spec` reads a checkpoint's ModelSpec
back into one),
`Layout` the parallel layout of one run, `build_gpt` this rank's stage of the model (call
`functional.cpu.init_distributed` first).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from dataclasses import dataclass

import torch

from mcore_proxy.mcore.megatron_args import ACTIVATIONS


# what short args leave to Megatron's defaults, and the fields that set it (at their defaults then)
ARGS_LEFT_TO_DEFAULTS = tuple(
    (
        "multi_latent_attention qk_layernorm group_query_attention num_query_groups kv_channels q_lora_rank "
        "kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rope_type rotary_scaling_factor rotary_base "
        "rotary_percent add_qkv_bias norm_epsilon untie_embeddings_and_output_weights mtp_num_layers "
        "mtp_loss_scaling_factor moe_router_topk_scaling_factor moe_router_pre_softmax "
        "pipeline_model_parallel_layout virtual_pipeline_model_parallel_size "
        "num_virtual_stages_per_pipeline_rank overlap_p2p_comm"
    ).split()
)
_FAMILY_FIELDS = tuple(
    (
        "attention num_query_groups kv_channels qk_layernorm q_lora_rank kv_lora_rank qk_head_dim "
        "qk_pos_emb_head_dim v_head_dim position_embedding_type mtp_layers topk_scaling_factor pre_softmax "
        "norm_epsilon rotary_base rotary_percent add_qkv_bias tied_embeddings"
    ).split()
)


@dataclass(frozen=True)
class ToyMoE:
    """A small MoE GPT as megatron-core builds it with its local (non-TE) spec: RMSNorm, no linear
    biases (megatron-core argument names where they exist), with the attention, position and MTP
    options of DeepSeek-V3- and Qwen3-MoE-shaped models.

    attention: "gqa" (`linear_qkv`, `num_query_groups`, head dim `kv_channels`) or "mla"
    (`linear_q_down_proj` [q_lora, H], `linear_q_up_proj` [heads*(qk+rope), q_lora],
    `linear_kv_down_proj` [kv_lora+rope, H], `linear_kv_up_proj` [heads*(qk+v), kv_lora]; with
    q_lora_rank None a single `linear_q_proj`). qk_layernorm: q/k norms for GQA, q/kv latent norms
    for MLA (the local MLA spec has none without it). `router_std` and `weight_seed` are how the
    test fixtures fill the weights, not structure.
    """

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64  # dense layers
    num_experts: int = 8
    moe_ffn_hidden_size: int = 16
    topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    vocab_size: int = 128
    seq_length: int = 16
    router_std: float = 1.0  # wide router rows: decisive, diverse routing
    weight_seed: int = 0  # different seeds: different router and expert weights
    activation: str = "swiglu"  # experts' and dense MLPs': "swiglu", "geglu" or "gelu"
    attention: str = "gqa"
    num_query_groups: int | None = None
    kv_channels: int | None = None
    qk_layernorm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    position_embedding_type: str = "rope"
    mtp_layers: int = 0
    topk_scaling_factor: float | None = None
    pre_softmax: bool = False  # softmax over all experts, then top-k (no renormalisation)
    norm_epsilon: float = 1e-5  # megatron's default layernorm_epsilon
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # RoPE on this share of each head's channels (GLM-4.5: 0.5)
    add_qkv_bias: bool = False  # biases of linear_qkv (Qwen2-MoE, GLM-4.5)
    tied_embeddings: bool = False  # megatron's default: the output layer is the word embeddings
    # the saved args leave attention, positions, norms, tying and MTP to Megatron's defaults
    # (`ARGS_LEFT_TO_DEFAULTS`), as hand-made args and the quickstart's do; for plain models only
    short_args: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        changed = [
            f.name for f in dataclasses.fields(self) if f.name in _FAMILY_FIELDS and getattr(self, f.name) != f.default
        ]
        if self.short_args and changed:
            raise ValueError(f"short args would leave {changed[0]} to Megatron's default: only for plain models")

    @property
    def _freq(self) -> int | list[int]:
        return list(self.moe_layer_freq) if isinstance(self.moe_layer_freq, tuple) else self.moe_layer_freq

    def transformer_config(self, layout: "Layout"):
        """megatron-core's TransformerConfig (MLATransformerConfig for MLA) of this model at `layout`
        (a `family.StagedLayout` adds its pipeline layout string)."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        mla = self.attention == "mla"
        attention = (
            dict(
                multi_latent_attention=True,
                q_lora_rank=self.q_lora_rank,
                kv_lora_rank=self.kv_lora_rank,
                qk_head_dim=self.qk_head_dim,
                qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
                v_head_dim=self.v_head_dim,
                rope_type="rope",
            )
            if mla
            else dict(num_query_groups=self.num_query_groups, kv_channels=self.kv_channels)
        )
        return (MLATransformerConfig if mla else TransformerConfig)(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.topk,
            moe_layer_freq=self._freq,
            moe_shared_expert_intermediate_size=self.shared_expert_size,
            moe_shared_expert_gate=self.shared_expert_gate,
            moe_router_score_function=self.score_function,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups,
            moe_router_group_topk=self.group_topk,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=layout.grouped,
            moe_router_pre_softmax=self.pre_softmax,
            moe_router_topk_scaling_factor=self.topk_scaling_factor,
            # Megatron-LM's --swiglu: SiLU-gated (core_transformer_config_from_args); GELU otherwise
            gated_linear_unit=self.activation != "gelu",
            activation_func=torch.nn.functional.silu if self.activation == "swiglu" else torch.nn.functional.gelu,
            add_bias_linear=False,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon,
            mtp_num_layers=self.mtp_layers or None,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            bf16=False,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            pipeline_model_parallel_layout=getattr(layout, "pipeline_layout", None),
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            num_layers_in_first_pipeline_stage=layout.first_stage_layers,
            sequence_parallel=False,
            **attention,
        )

    def megatron_args(self, layout: "Layout") -> argparse.Namespace:
        """`args` as Megatron-LM's argparse and validate_args leave them for this model: argparse
        names, a megatron enum, and the `signal.Signals` member Megatron-LM keeps as `exit_signal`
        (both pickled by name by early Python 3.11 releases: testing/enum_forms.py)."""
        from megatron.core.transformer.enums import AttnBackend

        mla, heads = self.attention == "mla", self.num_attention_heads
        vpp = getattr(layout, "vpp", None)
        args = argparse.Namespace(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.topk,
            moe_layer_freq=self._freq,
            moe_shared_expert_intermediate_size=self.shared_expert_size,
            moe_shared_expert_gate=self.shared_expert_gate,
            moe_router_score_function=self.score_function,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups,
            moe_router_group_topk=self.group_topk,
            moe_router_topk_scaling_factor=self.topk_scaling_factor,
            moe_router_pre_softmax=self.pre_softmax,
            moe_grouped_gemm=layout.grouped,
            moe_token_dispatcher_type="allgather",
            swiglu=self.activation == "swiglu",
            gated_linear_unit=self.activation != "gelu",
            add_bias_linear=False,
            add_qkv_bias=self.add_qkv_bias,
            normalization="RMSNorm",
            norm_epsilon=self.norm_epsilon,
            multi_latent_attention=mla,
            qk_layernorm=self.qk_layernorm,
            group_query_attention=not mla and self.num_query_groups not in (None, heads),
            num_query_groups=(self.num_query_groups or heads) if not mla else heads,
            kv_channels=self.kv_channels or self.hidden_size // heads,
            q_lora_rank=self.q_lora_rank if mla else None,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_head_dim,
            qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
            v_head_dim=self.v_head_dim,
            rope_type="rope" if mla else None,
            rotary_scaling_factor=1.0,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            padded_vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            max_position_embeddings=self.seq_length,
            position_embedding_type=self.position_embedding_type,
            untie_embeddings_and_output_weights=not self.tied_embeddings,
            mtp_num_layers=self.mtp_layers or None,
            mtp_loss_scaling_factor=0.1,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            decoder_first_pipeline_num_layers=layout.first_stage_layers,
            decoder_last_pipeline_num_layers=None,
            pipeline_model_parallel_layout=getattr(layout, "pipeline_layout", None),
            virtual_pipeline_model_parallel_size=vpp,
            num_layers_per_virtual_pipeline_stage=None,
            num_virtual_stages_per_pipeline_rank=None,
            overlap_p2p_comm=vpp is not None,
            use_distributed_optimizer=False,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            attention_backend=AttnBackend.auto,
            exit_signal=signal.SIGTERM,
            transformer_impl="local",
            world_size=layout.world_size,
            data_parallel_size=layout.world_size // (layout.tp * layout.pp),
            ckpt_format="torch",
            iteration=0,
        )
        for name in ARGS_LEFT_TO_DEFAULTS if self.short_args else ():
            delattr(args, name)
        return args


@dataclass(frozen=True)
class Layout:
    """A parallel layout of one run: TP/PP/EP/ETP, expert module, first-stage layer count."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: equal to tp, as Megatron defaults
    grouped: bool = False  # GroupedMLP (weight1/weight2) instead of SequentialMLP
    first_stage_layers: int | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def world_size(self) -> int:
        return max(self.tp * self.pp, self.ep * self.etp * self.pp)


def build_gpt(model: ToyMoE, layout: Layout):
    """Build this rank's pipeline stage of the GPT model (call after init_distributed): GQA or MHA
    with RoPE, untied, no MTP, no virtual stages; `functional.family.build_chunks` builds any ToyMoE."""
    if model.attention == "mla" or model.mtp_layers or model.tied_embeddings or model.position_embedding_type != "rope":
        raise ValueError(f"build_gpt builds plain GQA models; build {model} with functional.family.build_chunks")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = model.transformer_config(layout)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    gpt = GPTModel(
        config,
        spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        position_embedding_type="rope",
    )
    return gpt.eval()
