"""A small Megatron MoE GPT described by its args, built by megatron-core on CPU.

`ToyMoE` is a ModelSpec with small defaults and its weight fill (what `megatron_args` writes as a
checkpoint's args and `transformer_config` builds; `functional.family.family_from_spec` makes one
of a checkpoint's ModelSpec), `Layout` the parallel layout of one run, `build_gpt` this rank's
stage of the model (call `functional.cpu.init_distributed` first).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from dataclasses import dataclass

import torch

from mcore_proxy.mcore.megatron_args import ACTIVATIONS
from mcore_proxy.mcore.spec import MLA, ModelSpec


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
# the fields short args need at their defaults (what they leave to Megatron's defaults)
_LEFT_FIELDS = tuple(
    (
        "num_query_groups kv_channels qk_layernorm mla position_embedding_type mtp_layers topk_scaling_factor "
        "pre_softmax norm_epsilon rotary_base rotary_percent add_qkv_bias untie_embeddings"
    ).split()
)
# Megatron-LM's argparse defaults of the MLA sizes, which its args hold for any attention
_MLA_ARG_DEFAULTS = MLA(q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)


@dataclass(frozen=True)
class ToyMoE(ModelSpec):
    """A ModelSpec as megatron-core builds it here, with small defaults and how the weights are filled.

    Built with megatron-core's local (non-TE) spec: RMSNorm and no linear biases (whatever
    `normalization` and `add_bias_linear` say), GQA (`linear_qkv`, `num_query_groups`, head dim
    `kv_channels`) or, with `mla`, multi-latent attention (`linear_q_down_proj` [q_lora, H],
    `linear_q_up_proj` [heads*(qk+rope), q_lora], `linear_kv_down_proj` [kv_lora+rope, H],
    `linear_kv_up_proj` [heads*(qk+v), kv_lora]; with q_lora_rank None a single `linear_q_proj`).
    qk_layernorm: q/k norms for GQA, q/kv latent norms for MLA (the local MLA spec has none
    without it); `indexer`: megatron-core's DSA core attention (`functional.cpu.local_mla_spec`). The
    token mixers megatron-core 0.16 does not build (linear attention, DeepSeek-V4 attention, mHC,
    hash routing) are not built. `router_std` and `weight_seed` are
    how the test fixtures fill the weights, not structure.
    """

    num_layers: int = 4
    hidden_size: int = 32
    num_experts: int = 8
    topk: int = 2
    moe_layers: tuple[int, ...] | None = None  # None: every layer
    ffn_hidden_size: int = 64  # dense layers
    moe_ffn_hidden_size: int = 16
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    untie_embeddings: bool = True  # False: the output layer is the word embeddings (Megatron's default)
    router_std: float = 1.0  # wide router rows: decisive, diverse routing
    weight_seed: int = 0  # different seeds: different router and expert weights
    # the saved args leave attention, positions, norms, tying and MTP to Megatron's defaults
    # (`ARGS_LEFT_TO_DEFAULTS`), as hand-made args and the quickstart's do; for plain models only
    short_args: bool = False

    def __post_init__(self):
        if self.moe_layers is None:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
        if self.moe_layers != tuple(range(self.num_layers)):
            object.__setattr__(self, "stacked_layers", False)  # a per-layer moe_layer_freq
        super().__post_init__()
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if not set(self.moe_layers) <= set(range(self.num_layers)):
            raise ValueError(f"moe_layers {self.moe_layers} are not all below num_layers={self.num_layers}")
        defaults = {f.name: f.default for f in dataclasses.fields(ToyMoE)}
        changed = [name for name in _LEFT_FIELDS if getattr(self, name) != defaults[name]]
        if self.short_args and changed:
            raise ValueError(f"short args would leave {changed[0]} to Megatron's default: only for plain models")

    @property
    def tied_embeddings(self) -> bool:
        """The output layer is the word embeddings."""
        return not self.untie_embeddings

    @property
    def _freq(self) -> int | list[int]:
        """Megatron's `moe_layer_freq`: 1 for stacked layers (every layer MoE), else 1/0 per layer."""
        if self.stacked_layers:
            return 1
        return [int(L in self.moe_layers) for L in range(self.num_layers)]

    def transformer_config(self, layout: "Layout"):
        """megatron-core's TransformerConfig (MLATransformerConfig for MLA) of this model at `layout`
        (a `family.StagedLayout` adds its pipeline layout string), made from its full args as
        Megatron-LM's `core_transformer_config_from_args` makes it: every args field the config has,
        the expert count and norm epsilon renamed, the activation of `--swiglu`; then what a CPU run
        without training sets (no dropout, no load balancing, fp32 stages, CPU initialisation)."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        config = MLATransformerConfig if self.mla else TransformerConfig
        known = {f.name for f in dataclasses.fields(config)}
        args = {name: value for name, value in vars(self._full_args(layout)).items() if name in known}
        return config(
            **args,
            num_moe_experts=self.num_experts,
            layernorm_epsilon=self.norm_epsilon,
            activation_func=torch.nn.functional.silu if self.activation == "swiglu" else torch.nn.functional.gelu,
            num_layers_in_first_pipeline_stage=layout.first_stage_layers,
            pipeline_dtype=torch.float32,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            sequence_parallel=False,
        )

    def megatron_args(self, layout: "Layout") -> argparse.Namespace:
        """`args` as Megatron-LM's argparse and validate_args leave them for this model: argparse
        names, a megatron enum, and the `signal.Signals` member Megatron-LM keeps as `exit_signal`
        (both pickled by name by early Python 3.11 releases: testing/enum_forms.py). With
        `short_args`, without the fields Megatron's defaults give (`ARGS_LEFT_TO_DEFAULTS`)."""
        args = self._full_args(layout)
        for name in ARGS_LEFT_TO_DEFAULTS if self.short_args else ():
            delattr(args, name)
        return args

    def _full_args(self, layout: "Layout") -> argparse.Namespace:
        from megatron.core.transformer.enums import AttnBackend

        mla, heads = self.mla is not None, self.num_attention_heads
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
            **dataclasses.asdict(self.mla or _MLA_ARG_DEFAULTS),
            rope_type="rope" if mla else None,
            rotary_scaling_factor=1.0,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            padded_vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            max_position_embeddings=self.seq_length,
            position_embedding_type=self.position_embedding_type,
            untie_embeddings_and_output_weights=self.untie_embeddings,
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
        if self.indexer is not None:  # DeepSeek-V3.2's sparse attention (megatron-core's DSA)
            args.experimental_attention_variant = "dsa"
            args.dsa_indexer_n_heads, args.dsa_indexer_head_dim = self.indexer.n_heads, self.indexer.head_dim
            args.dsa_indexer_topk, args.dsa_indexer_loss_coeff = self.indexer.topk, 0.0
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
    if model.mla or model.mtp_layers or model.tied_embeddings or model.position_embedding_type != "rope":
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
