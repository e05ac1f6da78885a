"""Run by the fault tests in a fresh interpreter (megatron-core's parallel state is process-wide):
training steps of the tiny real megatron-core MoE GPT of mcore_proxy.testing, once per scenario,
each from the same initial weights, recording what the injectors can change.

    python scenarios.py OUT.pt NAME=SPEC [NAME=SPEC ...]     SPEC: a fault spec, or "none"
    python scenarios.py OUT.pt --env NAME [--mindspeed]      faults from MCORE_PROXY_FAULTS

--mindspeed: first do what MindSpeed does at start-up, against the MindSpeed stand-in on
PYTHONPATH: register a replacement of MoELayer.__init__ with its patch manager and apply it.

Scenario names ending in "_closed" attach the spec and detach it before training. Per scenario
and step: routing maps and probabilities of every router, the routed experts' output of every
MoE layer, logits of a no-grad (rollout) and a grad-enabled (training) forward on fixed tokens,
the parameters after the optimizer step, and the session's report.
"""

import sys
import warnings

import torch

STEPS = 4


def probes(gpt):
    """Forward hooks registered after the injectors, so they see the faulted outputs."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    seen, handles = {"probs": {}, "maps": {}, "experts": {}}, []
    for module in gpt.modules():
        if isinstance(module, MoELayer):
            lid = str(module.layer_number - 1)

            def on_router(mod, args, out, lid=lid):
                seen["probs"][lid], seen["maps"][lid] = out[0].detach().clone(), out[1].clone()

            def on_experts(mod, args, out, lid=lid):
                seen["experts"][lid] = out[0].detach().clone()

            handles.append(module.router.register_forward_hook(on_router))
            handles.append(module.experts.register_forward_hook(on_experts))
    return seen, handles


def train(gpt, initial, spec, model_cfg, from_env=False):
    from mcore_proxy import faults
    from mcore_proxy.faults.clock import CLOCK
    from mcore_proxy.functional.run import fixed_tokens

    gpt.load_state_dict(initial)
    CLOCK.reset()
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    session = None
    if not from_env and spec != "none":
        session = faults.inject(spec, model=gpt, optimizer=optimizer)
    seen, handles = probes(gpt)
    tokens = fixed_tokens(model_cfg, batch=4)
    s = tokens.shape[1]
    positions = torch.arange(s).expand(tokens.shape[0], s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    record = {k: [] for k in ("probs", "maps", "experts", "rollout_logits", "train_logits", "params")}
    for step in range(STEPS):
        with torch.no_grad():
            record["rollout_logits"].append(gpt(tokens, positions, mask).clone())
        logits = gpt(tokens, positions, mask)
        record["train_logits"].append(logits.detach().clone())
        for key in ("probs", "maps", "experts"):
            record[key].append(dict(seen[key]))
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record["params"].append(
            {k: v.detach().clone() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        )
    if from_env:
        from mcore_proxy.faults import runtime

        record["report"] = runtime.env_session().report()
    else:
        record["report"] = session.report() if session is not None else []
        if session is not None:
            session.close()
    for handle in handles:
        handle.remove()
    record["initial"] = initial
    record["expert_params"] = sorted(n for n, _ in gpt.named_parameters() if ".mlp.experts." in n)
    return record


def register_mindspeed_style_replacement():
    from mindspeed.patch_utils import MindSpeedPatchesManager

    from megatron.core.transformer.moe import moe_layer

    # the unwrapped megatron __init__: faults can then only attach through the wrapper registered
    # with the patch manager, which it applies on top of this replacement
    original = moe_layer.MoELayer.__init__
    original = getattr(original, "__wrapped__", original)

    def moe_layer_init(self, *args, **kwargs):  # a replacement, as MindSpeed-LLM registers them
        original(self, *args, **kwargs)
        self.replaced_by_mindspeed = True

    MindSpeedPatchesManager.register_patch("megatron.core.transformer.moe.moe_layer.MoELayer.__init__", moe_layer_init)
    MindSpeedPatchesManager.apply_patches()


def main():
    warnings.filterwarnings("ignore")
    if "--mindspeed" in sys.argv:
        register_mindspeed_style_replacement()
    from mcore_proxy.functional.model import Layout, ToyMoE, build_gpt
    from mcore_proxy.testing.build import diversify_weights
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

    out = sys.argv[1]
    init_distributed(0, 1, free_port())
    model_cfg = ToyMoE()
    gpt = build_gpt(model_cfg, Layout())
    diversify_weights(gpt, model_cfg)
    gpt.train()
    initial = {k: v.clone() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    results = {}
    if sys.argv[2] == "--env":
        results[sys.argv[3]] = train(gpt, initial, None, model_cfg, from_env=True)
        results[sys.argv[3]]["replaced"] = [
            getattr(m, "replaced_by_mindspeed", False) for m in gpt.modules() if hasattr(m, "router")
        ]
    else:
        for arg in sys.argv[2:]:
            name, _, spec = arg.partition("=")
            if name.endswith("_closed"):
                from mcore_proxy import faults

                gpt.load_state_dict(initial)
                faults.inject(spec, model=gpt).close()  # attached, then switched off
                spec = "none"
            results[name] = train(gpt, initial, spec, model_cfg)
    torch.save(results, out)
    destroy_distributed()


if __name__ == "__main__":
    main()
