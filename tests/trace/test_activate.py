"""The post-import finder: watched modules import normally, then the callback sees them once."""

import sys

import pytest

from mcore_proxy.trace import activate
from mcore_proxy.trace.activate import PostImportFinder


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    pkg = tmp_path / "fakemeg"
    (pkg / "moe").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "moe" / "__init__.py").write_text("")
    (pkg / "moe" / "router.py").write_text("class TopKRouter:\n    def forward(self, x):\n        return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakemeg.moe.router"
    for name in [n for n in sys.modules if n.startswith("fakemeg")]:
        del sys.modules[name]


def test_callback_runs_after_the_module_executed(fake_package):
    seen = []
    finder = PostImportFinder({fake_package: lambda m: seen.append(m.TopKRouter.forward(None, 3))})
    sys.meta_path.insert(0, finder)
    try:
        import fakemeg.moe.router as router

        assert seen == [3]  # the class existed when it ran
        assert router.__spec__.loader.get_filename(fake_package).endswith("router.py")
        assert fake_package not in finder.pending
        del sys.modules[fake_package]
        import fakemeg.moe.router  # noqa: F401,F811 - a re-import does not call back again

        assert seen == [3]
    finally:
        sys.meta_path.remove(finder)


def test_unwatched_and_missing_modules_are_left_alone(fake_package):
    finder = PostImportFinder({"fakemeg.moe.absent": lambda m: None})
    sys.meta_path.insert(0, finder)
    try:
        import fakemeg.moe.router as router

        assert not hasattr(router.__spec__.loader, "_callback")
        with pytest.raises(ModuleNotFoundError):
            import fakemeg.moe.absent  # noqa: F401
    finally:
        sys.meta_path.remove(finder)


def test_no_environment_no_activation(monkeypatch):
    monkeypatch.delenv(activate.ENV_DIR, raising=False)
    before = list(sys.meta_path)
    assert activate.activate_from_env() is False
    assert sys.meta_path == before
