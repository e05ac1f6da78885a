"""Neutralise the few CUDA calls megatron-core 0.16.1 makes, so it builds, runs and saves on CPU.

This is the only place that patches megatron-core (DESIGN.md 5). It replaces exactly:
torch.cuda.current_device / synchronize (router weight placement, dist-checkpoint save), the
CUDA RNG tracker's `fork` (dropout regions), the TE-only symbols megatron's MoE utilities
reference even without Transformer Engine, the `grouped_gemm` op GroupedMLP calls (with a
pure-torch grouped GEMM), and the `.cuda()` of the MTP stage's tied embedding. Call `patch_megatron_for_cpu()` before
building a model.

Multi-latent attention without Transformer Engine (not installable here) needs two more, one a
patch (`multi_latent_attention.HAVE_TE`) and one a spec edit (`local_mla_spec`); see there.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket

import torch

_PATCHED = False


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False):
    """Pure-torch stand-in for grouped_gemm.ops.gmm: a [T, K] split by batch_sizes, b [G, K, N]."""
    outs, start = [], 0
    for g, n in enumerate(batch_sizes.tolist()):
        w = b[g].t() if trans_b else b[g]
        outs.append(a[start : start + n] @ w)
        start += n
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])


class _GroupedGemmOps:
    gmm = staticmethod(_grouped_gemm)


class _GroupedGemmModule:
    ops = _GroupedGemmOps


def stub_cuda_for_cpu() -> None:
    """What any megatron-core (0.16.1, and Megatron-LM's dev tree, which
    bench/deepseek_v4_megatron_dev.py runs) needs to build and run on a CPU-only torch: the CUDA
    device, synchronisation and NVTX ranges as no-ops, the CUDA RNG tracker's fork without a CUDA
    generator, and the Transformer Engine symbols MoE utilities reference set to None where absent.
    Idempotent; no formula changes."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def _fork(self, name=None):  # CPU generator only: dropout is off in these models anyway
        yield

    mrandom.CudaRNGStatesTracker.fork = _fork
    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, seed)

    from megatron.core.transformer.moe import moe_utils

    for symbol in (
        "te_general_gemm",
        "fused_topk_with_score_function",
        "fused_permute",
        "fused_unpermute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
    ):
        if not hasattr(moe_utils, symbol):
            setattr(moe_utils, symbol, None)


def patch_megatron_for_cpu() -> None:
    """Idempotent; safe in every spawned rank."""
    global _PATCHED
    if _PATCHED:
        return
    stub_cuda_for_cpu()

    from megatron.core.transformer.moe import experts, grouped_gemm_util

    grouped_gemm_util.grouped_gemm = _GroupedGemmModule
    grouped_gemm_util.ops = _GroupedGemmOps
    grouped_gemm_util.grouped_gemm_is_available = lambda: True
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    if hasattr(experts, "gg"):
        experts.gg = grouped_gemm_util
    _lift_grouped_mlp_bf16_assert(experts.GroupedMLP)
    _keep_tied_embeddings_on_cpu()
    _mla_sees_te_absent()
    _dsa_without_hadamard_kernel()
    _PATCHED = True


def _dsa_without_hadamard_kernel() -> None:
    """megatron-core's DSA indexer rotates its queries and keys by `fast_hadamard_transform`, a CUDA
    kernel that asserts bf16 (`dsa.rotate_activation`). The scaled Hadamard matrix is orthonormal and
    rotates both, and the indexer uses them only in q . k, so its scores are the same without it:
    the identity stands in."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    dsa.rotate_activation = lambda x: x


def _mla_sees_te_absent() -> None:
    """Without Transformer Engine, `megatron.core.extensions.transformer_engine` still imports:
    it puts a MagicMock in place of `transformer_engine`, so `TELinear` (a subclass of a mock)
    is a mock object, not a class, and `multi_latent_attention`'s guarded import of it succeeds
    with HAVE_TE = True. `MultiLatentAttention.__init__` then calls
    `isinstance(self.linear_proj, TELinear)` and raises TypeError. Tell MLA what the extension
    module itself knows."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = bool(te_ext.HAVE_TE)


def local_mla_spec(spec, dsa: bool = False):
    """Copy of a layer or block spec whose MLA layers use `MLACoreAttention` instead of the local
    `DotProductAttention` (GQA layers are left alone), or with `dsa` megatron-core's DSA core
    attention and indexer (DeepSeek-V3.2; `_dsa_core_attention`).

    `MultiLatentAttention.__init__` builds its core attention with `k_channels` and `v_channels`
    (query/key head dim qk + rope, value head dim v), which only `TEDotProductAttention`
    accepts; the local `DotProductAttention` of megatron-core 0.16.1 takes neither and sizes its
    output by kv_channels x heads. The local MLA spec is therefore unbuildable without TE, on
    any device.
    """
    import copy
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    def walk(obj):
        if isinstance(obj, MLASelfAttentionSubmodules):
            if obj.core_attention is DotProductAttention:
                obj.core_attention = _dsa_core_attention() if dsa else _mla_core_attention_class()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    spec = copy.deepcopy(spec)
    walk(spec)
    return spec


_MLA_CORE_ATTENTION = None


class DuplicatedLinear(torch.nn.Module):
    """What TELinear(parallel_mode="duplicated") computes: the whole linear, no bias, on every TP
    rank (the DSA indexer's wq_b, wk and weights_proj), for megatron-core's local spec, which has
    no such module. Returns (output, None) as megatron's linears do, and keeps TE's `_extra_state`
    key (its FP8 metadata, empty without FP8), so checkpoints of TE models load strictly."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        with torch.no_grad():
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


def _dsa_core_attention():
    """megatron-core 0.16.1's DSA core attention (`DSAttention` with its `DSAIndexer`) as a module
    spec built from local modules: its stock spec needs Transformer Engine (`backend.linear()`)."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    indexer = dsa.DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear,
        linear_wk=DuplicatedLinear,
        k_norm=WrappedTorchNorm,
        linear_weights_proj=DuplicatedLinear,
    )
    return ModuleSpec(
        module=dsa.DSAttention,
        submodules=dsa.DSAttentionSubmodules(indexer=ModuleSpec(module=dsa.DSAIndexer, submodules=indexer)),
    )


def _mla_core_attention_class():
    """megatron's local DotProductAttention that takes MLA's head dims: the scores use the query
    and key tensors as given (head dim qk + rope), and the output is heads/TP x v_channels wide.
    Built on first use so that importing this module does not import megatron."""
    global _MLA_CORE_ATTENTION
    if _MLA_CORE_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLACoreAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)
                if v_channels is not None:  # the Attention base class builds one without them first
                    self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        _MLA_CORE_ATTENTION = MLACoreAttention
    return _MLA_CORE_ATTENTION


def _keep_tied_embeddings_on_cpu() -> None:
    """With MTP on a later pipeline stage, megatron-core ties that stage's copy of the word
    embeddings to the first stage's by an all-reduce after `weight.data.cuda()`
    (`LanguageModule.setup_embeddings_and_output_layer`); gloo all-reduces CPU tensors, so
    there `Tensor.cuda` is the identity, and only there."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = saved

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _lift_grouped_mlp_bf16_assert(cls) -> None:
    """GroupedMLP asserts bf16 because the CUDA grouped GEMM is bf16-only; the pure-torch GEMM
    is not, and fp32 lets tests compare outputs tightly. The flag is restored after the call."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        saved, self.config.bf16 = self.config.bf16, True
        try:
            return original(self, *args, **kwargs)
        finally:
            self.config.bf16 = saved

    cls.forward = forward


def free_port() -> int:
    """A TCP port free now for a gloo store to listen on. Chosen below Linux's ephemeral range
    (32768-60999): a port from bind(0) is released before the store binds it, and in between any
    process's bind(0) or outgoing connection could take it (seen as EADDRINUSE with several test
    workers starting worlds side by side); below that range only another free_port could."""
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int, world_size: int, port: int, *, tp=1, pp=1, ep=1, etp=None, vpp=None, seed: int = 1234
) -> None:
    """gloo process group and megatron parallel state for one CPU rank."""
    import warnings

    # every spawned rank would repeat megatron's "Transformer Engine not installed" notices
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    patch_megatron_for_cpu()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
