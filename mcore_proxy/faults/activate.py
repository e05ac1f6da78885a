"""The fault injectors as a feature of `mcore_proxy.activation`: switched on by `MCORE_PROXY_FAULTS`.
Standard library only. When the watched modules are imported, `mcore_proxy.faults.runtime`:

    megatron.core.transformer.moe.moe_layer   -> wrap MoELayer.__init__ (router and experts faults)
    megatron.core.models.gpt.gpt_model        -> wrap GPTModel.__init__ (output-layer faults)
    torch.optim.optimizer                     -> global optimizer step hooks (update omission, clock)
    transformers.modeling_utils               -> wrap PreTrainedModel.post_init (HF MoE blocks, lm_head)
    transformers.generation.utils             -> GenerationMixin.generate runs as a rollout phase
    trl.trainer.utils                         -> TRL's fused LM head (log-prob passes that never
                                                 call lm_head) sees the output-logit faults
    mindspeed.patch_utils                     -> register the __init__ wrappers with
                                                 MindSpeedPatchesManager
    vllm.model_executor.model_loader.base_loader -> every model vLLM loads gets the session on its
                                                 routers and logits (engines/vllm.py)
"""

from __future__ import annotations

from mcore_proxy.activation import Feature
from mcore_proxy.faults.spec import ENV_FAULTS

WATCHED = {
    "megatron.core.transformer.moe.moe_layer": "patch_moe_layer_module",
    "megatron.core.models.gpt.gpt_model": "patch_gpt_model_module",
    "torch.optim.optimizer": "patch_torch_optimizer_module",
    "transformers.modeling_utils": "patch_transformers_module",
    "transformers.generation.utils": "patch_generation_module",
    "trl.trainer.utils": "patch_trl_module",
    "mindspeed.patch_utils": "patch_mindspeed_module",
    "vllm.model_executor.model_loader.base_loader": "patch_vllm_loader_module",
}

FEATURE = Feature(
    "faults", ENV_FAULTS, "mcore_proxy.faults.runtime", WATCHED, check="mcore_proxy.faults.spec:check_env"
)
