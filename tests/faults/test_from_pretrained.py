"""Environment activation on a model loaded by `from_pretrained` (how TRL and every HF trainer
builds its policy and reference): transformers replaces the parameters after `post_init`, where
the injectors attach, so injectors must look the parameters up when they act, not when attached."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {here!r})
from test_hf import tiny_qwen3_moe, TOKENS
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
tiny_qwen3_moe().save_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).train()
initial = {{k: v.detach().clone() for k, v in model.named_parameters()}}
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(TOKENS, labels=TOKENS).loss.backward()
opt.step()
moved = sorted(k for k, v in model.named_parameters() if not torch.equal(v, initial[k]))
from mcore_proxy.faults import runtime
injector = runtime.env_session().injectors[-1]
rms = model.model.layers[0].mlp.gate.weight.detach().float().pow(2).mean().sqrt().item()
delta = [v for v in injector._perturbation.values()] if hasattr(injector, "_perturbation") else []
print(json.dumps({{"moved": moved, "rms": rms,
                  "delta_rms": [d.pow(2).mean().sqrt().item() for d in delta]}}))
"""


@pytest.mark.parametrize(
    "spec", ["update_omission:group=experts", "update_omission:group=experts;router_weight:std=0.5"]
)
def test_injectors_act_on_the_loaded_parameters(helpers, tmp_path, spec):
    code = SCRIPT.format(here=str(helpers.REPO / "tests" / "faults"))
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=helpers.user_env(helpers.PATCHES, MCORE_PROXY_FAULTS=spec),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["moved"] and not [k for k in out["moved"] if ".mlp.experts." in k]  # experts held back
    assert any(".self_attn." in k for k in out["moved"])
    if "router_weight" in spec:
        # N's scale is the loaded router weight's rms (one perturbation per layer: 2 layers)
        assert len(out["delta_rms"]) == 2
        assert out["delta_rms"][0] == pytest.approx(0.5 * out["rms"], rel=0.1)
