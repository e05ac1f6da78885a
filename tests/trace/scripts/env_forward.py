"""Run by test_runtime.py in a fresh interpreter: one forward pass of the tiny test model, with
routing statistics switched on by the environment alone. This script never imports
mcore_proxy.trace; it uses mcore_proxy.testing only as the CPU stand-in for a GPU and for the
test model (identical global weights, the tokens of the other tests).

--mindspeed: first do what MindSpeed-LLM does at start-up, against the MindSpeed stand-in on
PYTHONPATH: register a replacement of TopKRouter.forward with the patch manager and apply.
Prints one JSON line: the replacement's calls and the final TopKRouter.forward's name.
"""

import json
import sys

CALLS = []


def register_mindspeed_style_replacement():
    from mindspeed.patch_utils import MindSpeedPatchesManager

    def topk_router_forward(self, input, padding_mask=None):  # a re-implementation, as MindSpeed-LLM's
        CALLS.append(self.layer_number)
        logits = self.gating(input)
        return self.routing(logits, padding_mask=padding_mask)

    MindSpeedPatchesManager.register_patch(
        "megatron.core.transformer.moe.router.TopKRouter.forward", topk_router_forward
    )
    MindSpeedPatchesManager.apply_patches()


def main():
    if "--mindspeed" in sys.argv:
        register_mindspeed_style_replacement()
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
    from mcore_proxy.testing.trace_runs import TraceRun, build_stage, forward, replica_tokens

    init_distributed(0, 1, free_port())
    run = TraceRun()
    gpt = build_stage(run)
    tokens, pad, _ = replica_tokens(run)
    forward(gpt, run, tokens, pad)
    from megatron.core.transformer.moe.router import TopKRouter

    forward_fn = TopKRouter.forward
    print(
        json.dumps(
            {
                "calls": CALLS,
                "forward": forward_fn.__name__,
                "traced": bool(getattr(forward_fn, "__mcore_proxy_traced__", False)),
                "trace_imported": "mcore_proxy.trace.runtime" in sys.modules,
            }
        )
    )
    destroy_distributed()


if __name__ == "__main__":
    main()
