"""Activation by environment (patches/ on PYTHONPATH, MCORE_PROXY_FAULTS) in fresh interpreters:
the same injection as from code, bit for bit; MindSpeed's patch manager (its stand-in) replacing
MoELayer.__init__ does not lose the injectors; a malformed variable stops the launch at start."""

import importlib
import json
import subprocess
import sys

import pytest

from mcore_proxy import activation
from mcore_proxy.faults import runtime

COMBINED = "router_noise:std=0.5,start=1;update_omission:every=2;logprob_precision"


def test_sitecustomize_knows_every_feature_variable(helpers):
    text = (helpers.PATCHES / "sitecustomize.py").read_text()
    listed = text.split("_ENV_VARS = (")[1].split(")")[0]
    assert tuple(v.strip().strip('"') for v in listed.split(",") if v.strip()) == activation.env_vars()


def test_a_malformed_variable_stops_the_process_at_start(helpers):
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print('ran')"],
        capture_output=True,
        text=True,
        env=helpers.user_env(helpers.PATCHES, MCORE_PROXY_FAULTS="topk:rate=3"),
    )
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "mcore-proxy: MCORE_PROXY_FAULTS='topk:rate=3': fault 'topk:rate=3': rate=3 is invalid "
        "(must be within [0, 1]); fix the variable or unset it"
    ]


def test_faults_alone_stay_light_until_torch_is_imported(helpers):
    probe = (
        "import sys, json; before = 'torch' in sys.modules; import torch.optim; "
        "print(json.dumps([before, 'mcore_proxy.faults.runtime' in sys.modules, "
        "'mcore_proxy.faults.session' in sys.modules]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=helpers.user_env(helpers.PATCHES, MCORE_PROXY_FAULTS="update_omission"),
    )
    assert proc.returncode == 0, proc.stderr
    # torch not loaded by the activation; torch's optimizer module got the global step hooks, and
    # the torch-based session is created only when the first optimizer steps
    assert json.loads(proc.stdout) == [False, True, False]


@pytest.fixture
def standin_manager(monkeypatch, helpers):
    monkeypatch.syspath_prepend(str(helpers.STANDIN))
    for name in ("mindspeed", "mindspeed.patch_utils"):
        sys.modules.pop(name, None)
    module = importlib.import_module("mindspeed.patch_utils")
    module.MindSpeedPatchesManager.patches_info = {}
    yield module
    for name in ("mindspeed", "mindspeed.patch_utils"):
        sys.modules.pop(name, None)


def test_registered_with_mindspeed_as_wrappers(standin_manager):
    runtime.patch_mindspeed_module(standin_manager)
    info = standin_manager.MindSpeedPatchesManager.patches_info
    assert {name: (p.patch_func, [w.__name__ for w in p.wrappers]) for name, p in info.items()} == {
        runtime.MOE_LAYER_INIT: (None, ["faults_moe_layer_init_wrapper"]),  # wrappers, not
        runtime.GPT_MODEL_INIT: (None, ["faults_gpt_model_init_wrapper"]),
    }  # replacements


@pytest.mark.megatron
@pytest.mark.parametrize("mindspeed", [False, True])
def test_environment_equals_code_bit_for_bit(tmp_path, helpers, scenarios, mindspeed):
    report = tmp_path / "faults.json"
    env = helpers.user_env(
        helpers.PATCHES,
        *([helpers.STANDIN] if mindspeed else []),
        MCORE_PROXY_FAULTS=COMBINED,
        MCORE_PROXY_FAULTS_REPORT=report,
    )
    runs = helpers.run_scenarios(tmp_path / "env.pt", ["--env", "env"] + ["--mindspeed"] * mindspeed, env)
    by_env, by_code = runs["env"], scenarios["combined"]
    assert helpers.SCENARIOS["combined"] == COMBINED
    for field in ("maps", "probs", "experts", "rollout_logits", "train_logits", "params"):
        assert helpers.same(by_env[field], by_code[field]), field
    assert by_env["report"] == by_code["report"]
    assert not helpers.same(by_env["params"], scenarios["none"]["params"])
    assert all(by_env["replaced"]) == mindspeed and len(by_env["replaced"]) == 4
    written = json.loads(report.read_text())
    assert written["faults"] == COMBINED and written["report"] == by_code["report"]


def test_inject_refuses_while_the_environment_injects(monkeypatch):
    from mcore_proxy import faults

    monkeypatch.setenv("MCORE_PROXY_FAULTS", "topk")
    with pytest.raises(RuntimeError, match="already injected through MCORE_PROXY_FAULTS"):
        faults.inject("router_noise")
