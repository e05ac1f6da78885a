"""The wrappers of environment activation: idempotent, once per nested call, and registered
with MindSpeed's patch manager (its stand-in: tests/trace/mindspeed_standin) as `*_wrapper`."""

import importlib
import sys
from pathlib import Path

import pytest

from mcore_proxy.trace import megatron, runtime

STANDIN = Path(__file__).parent / "mindspeed_standin"


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Calls that would reach the tracer, as (router, args)."""
    calls = []
    monkeypatch.setenv(runtime.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(
        megatron, "record_router_call", lambda tracer, router, args, kwargs, out: calls.append((router, args))
    )
    monkeypatch.setattr(runtime, "env_tracer", lambda: None)
    return calls


class Router:
    def forward(self, x, padding_mask=None):
        return x, x


def test_wrapping_is_idempotent_and_records_once(recorded):
    traced = runtime.traced_router_forward(Router.forward)
    assert runtime.traced_router_forward(traced) is traced
    assert runtime.trace_router_forward_wrapper(traced) is traced
    router = Router()
    assert traced(router, 5) == (5, 5)
    assert recorded == [(router, (5,))]


def test_replacement_calling_the_traced_original_records_once(recorded):
    original = runtime.traced_router_forward(Router.forward)

    def replacement(self, x, padding_mask=None):  # e.g. a MindSpeed forward delegating
        return original(self, x, padding_mask)

    outer = runtime.trace_router_forward_wrapper(replacement)
    outer(Router(), 7)
    assert len(recorded) == 1
    original(Router(), 8)  # the nesting flag was reset
    assert len(recorded) == 2


def test_without_the_environment_the_wrapper_passes_through(recorded, monkeypatch):
    monkeypatch.delenv(runtime.ENV_DIR)
    runtime.traced_router_forward(Router.forward)(Router(), 1)
    assert recorded == []


@pytest.fixture
def standin_manager(monkeypatch):
    """The MindSpeed patch-manager stand-in, imported fresh."""
    monkeypatch.syspath_prepend(str(STANDIN))
    for name in ("mindspeed", "mindspeed.patch_utils"):
        sys.modules.pop(name, None)
    module = importlib.import_module("mindspeed.patch_utils")
    module.MindSpeedPatchesManager.patches_info = {}
    yield module
    for name in ("mindspeed", "mindspeed.patch_utils"):
        sys.modules.pop(name, None)


def test_registered_with_mindspeed_as_wrappers(standin_manager, monkeypatch):
    monkeypatch.setenv(runtime.ENV_SALIENCY, "1")
    runtime.patch_mindspeed_module(standin_manager)
    info = standin_manager.MindSpeedPatchesManager.patches_info
    assert set(info) == {runtime.ROUTER_FORWARD, runtime.MOE_LAYER_INIT}
    for patch in info.values():  # wrappers, not replacements: both coexist
        assert patch.patch_func is None and len(patch.wrappers) == 1
        assert patch.wrappers[0].__name__.endswith("_wrapper")

    def topk_router_forward(self, x, padding_mask=None):  # MindSpeed-LLM's replacement
        return x, x

    standin_manager.MindSpeedPatchesManager.register_patch(runtime.ROUTER_FORWARD, topk_router_forward)
    assert info[runtime.ROUTER_FORWARD].patch_func is topk_router_forward


def test_install_refuses_when_the_environment_already_traces(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.ENV_DIR, str(tmp_path))
    with pytest.raises(RuntimeError, match="already collected through MCORE_PROXY_TRACE_DIR"):
        megatron.install(object(), tmp_path)


def test_model_layers_from_config():
    from types import SimpleNamespace

    config = SimpleNamespace(
        num_layers=6, moe_layer_freq=[0, 1, 1, 1, 1, 1], mtp_num_layers=1, first_k_dense_replace=2, noop_layers={4}
    )
    assert megatron.model_layers(config) == ["2", "3", "5", "mtp.0"]
    assert megatron.model_layers(SimpleNamespace(num_layers=4, moe_layer_freq=2)) == ["0", "2"]
    assert megatron.model_layers(SimpleNamespace(num_layers=4, moe_layer_freq=[1])) is None
