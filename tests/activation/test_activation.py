"""The one post-import activation that the trace and the fault injectors share."""

import sys

import pytest

from mcore_proxy import activation
from mcore_proxy.activation import Feature, PostImportFinder
from mcore_proxy.core.errors import ProxyError


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    (tmp_path / "fakewatched.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakewatched"
    sys.modules.pop("fakewatched", None)


def test_several_callbacks_of_one_module_run_once_each(fake_module):
    seen = []
    finder = PostImportFinder()
    finder.add(fake_module, lambda m: seen.append(("trace", m.VALUE)))
    finder.add(fake_module, lambda m: seen.append(("faults", m.VALUE)))
    sys.meta_path.insert(0, finder)
    try:
        import fakewatched  # noqa: F401

        assert seen == [("trace", 3), ("faults", 3)]
        finder.add(fake_module, lambda m: seen.append(("late", m.VALUE)))  # already imported: now
        assert seen[-1] == ("late", 3)
    finally:
        sys.meta_path.remove(finder)


def test_both_features_are_registered_and_inactive_without_their_variables(monkeypatch):
    names = [f.name for f in activation.features()]
    assert names == ["trace", "faults"]
    for variable in activation.env_vars():
        monkeypatch.delenv(variable, raising=False)
    before = list(sys.meta_path)
    assert activation.activate_from_env() == ()
    assert sys.meta_path == before


def test_a_feature_check_fails_before_anything_is_watched(monkeypatch):
    monkeypatch.setenv("MCORE_PROXY_FAULTS", "not_a_fault")
    feature = Feature(
        "faults-check",
        "MCORE_PROXY_FAULTS",
        "mcore_proxy.faults.runtime",
        {"never.imported": "patch_moe_layer_module"},
        check="mcore_proxy.faults.spec:check_env",
    )
    with pytest.raises(ProxyError, match="MCORE_PROXY_FAULTS='not_a_fault': .*unknown kind"):
        activation.activate(feature)
    assert activation._FINDER is None or "never.imported" not in activation._FINDER.callbacks
