"""Activation by environment: the process-wide fault session of `MCORE_PROXY_FAULTS`.

`mcore_proxy.faults.activate` calls the `patch_*` functions below right after the watched modules
are imported. Imports here are torch-free at module level: `torch.optim.optimizer` is watched, and
its callback runs while `import torch` is still under way.

- megatron: `MoELayer.__init__` and `GPTModel.__init__` are wrapped so that every MoE layer and
  GPT model the run builds gets the session's injectors (layer filters resolve at call time, after
  megatron has set `layer_number`).
- optimizers: torch's global optimizer step hooks (every torch optimizer, megatron's inner ones
  included) run the `update_omission` faults and move the step clock.
- MindSpeed: its patch manager may *replace* `MoELayer.__init__` or `GPTModel.__init__`, which
  would drop a plain wrapper; the same wrappers are registered with `MindSpeedPatchesManager` as
  `*_wrapper`, which the manager applies on top of any replacement. Wrapping is idempotent and
  each module is attached once.
- transformers: `PreTrainedModel.post_init` (run at the end of every model's `__init__`) attaches
  the session to the model's sparse MoE blocks and `lm_head`; `GenerationMixin.generate` runs
  inside `mcore_proxy.faults.rollout()` (generation is the rollout of an RL framework that samples
  with transformers, e.g. TRL without vLLM), which is what `logprob_precision:when=rollout` acts on.
- TRL: its trainers compute log-probs through a fused LM head that reads `lm_head.weight` without
  calling `lm_head`; `faults/fused_head.py` makes the output-logit faults reach those passes.
- vLLM: every model its loaders build gets the session on its routers (`vllm_router` sites) and
  its `LogitsProcessor` (an `output` site): faults set in the rollout engine's environment act in
  the engine only.
- `MCORE_PROXY_FAULTS_REPORT=FILE`: at exit, write what each fault did as JSON (rank-suffixed
  `FILE.rank{R}` when several ranks run).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading

from mcore_proxy.activation import register_with_mindspeed
from mcore_proxy.faults.spec import ENV_FAULTS, parse_env

log = logging.getLogger(__name__)

ENV_REPORT = "MCORE_PROXY_FAULTS_REPORT"
MOE_LAYER_INIT = "megatron.core.transformer.moe.moe_layer.MoELayer.__init__"
GPT_MODEL_INIT = "megatron.core.models.gpt.gpt_model.GPTModel.__init__"
_MARK = "__mcore_proxy_faults__"

_SESSION = None
_LOCK = threading.Lock()


def env_session():
    """The process-wide session of `MCORE_PROXY_FAULTS`, created on first use."""
    global _SESSION
    if _SESSION is None:
        with _LOCK:
            if _SESSION is None:
                from mcore_proxy.faults.session import FaultSession

                session = FaultSession(parse_env())
                log.info("faults: %s", "; ".join(i.spec.to_text() for i in session.injectors))
                if os.environ.get(ENV_REPORT):
                    atexit.register(write_report, session)
                _SESSION = session
    return _SESSION


def write_report(session) -> None:
    path = os.environ[ENV_REPORT]
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    if world != "1":
        path = f"{path}.rank{rank}"
    with open(path, "w") as f:
        json.dump({"faults": os.environ.get(ENV_FAULTS), "report": session.report()}, f, indent=1)


def _wrap_init(init, attach):
    """`cls.__init__` that attaches the env session to the new instance afterwards."""
    if getattr(init, _MARK, False):
        return init

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        attach(self)

    setattr(wrapped, _MARK, True)
    return wrapped


def _attach_moe_layer(layer) -> None:
    from mcore_proxy.faults.sites import moe_layer_sites

    env_session().attach_sites(moe_layer_sites(layer))


def _attach_gpt_model(gpt) -> None:
    from mcore_proxy.faults.sites import gpt_model_sites

    env_session().attach_sites(gpt_model_sites(gpt))


def _attach_hf_model(model) -> None:
    from mcore_proxy.faults import hf

    env_session().attach_sites(hf.find_sites(model))


# MindSpeed's patch manager applies a registered function whose name ends in "wrapper" on top of
# the (possibly replaced) original: keep these names.
def faults_moe_layer_init_wrapper(init):
    return _wrap_init(init, _attach_moe_layer)


def faults_gpt_model_init_wrapper(init):
    return _wrap_init(init, _attach_gpt_model)


def patch_moe_layer_module(module) -> None:
    module.MoELayer.__init__ = faults_moe_layer_init_wrapper(module.MoELayer.__init__)


def patch_gpt_model_module(module) -> None:
    module.GPTModel.__init__ = faults_gpt_model_init_wrapper(module.GPTModel.__init__)


def patch_transformers_module(module) -> None:
    cls = module.PreTrainedModel
    cls.post_init = _wrap_init(cls.post_init, _attach_hf_model)


_ROLLOUT = "__mcore_proxy_faults_rollout__"


def patch_generation_module(module) -> None:
    """`GenerationMixin.generate` as a rollout phase (idempotent; subclasses that override
    `generate` and call it nest, which the phase counts)."""
    cls = getattr(module, "GenerationMixin", None)
    if cls is None or getattr(cls.generate, _ROLLOUT, False):
        return
    generate = cls.generate

    @functools.wraps(generate)
    def rollout_generate(self, *args, **kwargs):
        from mcore_proxy.faults.clock import rollout

        with rollout():
            return generate(self, *args, **kwargs)

    setattr(rollout_generate, _ROLLOUT, True)
    cls.generate = rollout_generate


def patch_trl_module(module) -> None:
    """Called once `trl.trainer.utils` is imported."""
    from mcore_proxy.faults.fused_head import patch_trl_module as patch

    patch(module)


def _pre_step(optimizer, args, kwargs):
    session = env_session()
    for injector in session.injectors:
        if hasattr(injector, "pre_step"):
            injector.pre_step(optimizer)


def _post_step(optimizer, args, kwargs):
    session = env_session()
    for injector in session.injectors:
        if hasattr(injector, "post_step"):
            injector.post_step(optimizer)
    session.clock.advance(optimizer)


def patch_torch_optimizer_module(module) -> None:
    """Called while torch imports `torch.optim.optimizer`: only that module's own functions."""
    module.register_optimizer_step_pre_hook(_pre_step)
    module.register_optimizer_step_post_hook(_post_step)


def _attach_vllm_model(model) -> None:
    from mcore_proxy.faults.sites import vllm_sites

    env_session().attach_sites(vllm_sites(model))


def patch_vllm_loader_module(module) -> None:
    """Called once vLLM's `model_loader.base_loader` is imported: the rollout engine's models get
    the session (the faults then act in the engine only, where the environment sets them)."""
    from mcore_proxy.engines import vllm as vllm_engine

    vllm_engine.on_model_loaded(_attach_vllm_model)
    vllm_engine.patch_loader_module(module)


def patch_mindspeed_module(module) -> None:
    """Called once `mindspeed.patch_utils` is imported."""
    register_with_mindspeed(
        module, {MOE_LAYER_INIT: faults_moe_layer_init_wrapper, GPT_MODEL_INIT: faults_gpt_model_init_wrapper}, "faults"
    )
