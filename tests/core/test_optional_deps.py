"""Issue 22 item 3: a command that needs an optional package the install lacks says which extra
to install in one sentence and exits 2, never "internal error: ModuleNotFoundError" (exit 3).

Absence is made real in this process: a `sys.modules` entry of None makes `import X` raise
ModuleNotFoundError and `importlib.util.find_spec(X)` refuse, as for a package that is not
installed. tests/tools/test_wheel.py runs the commands in an environment really without extras.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import pytest

from mcore_proxy import cli
from mcore_proxy.core import optional
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.core.optional import MissingDependency, check, from_import_error, require

REPO = Path(__file__).resolve().parents[2]


def absent(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def setup_extras() -> dict[str, set[str]]:
    """extras_require of setup.py, read without running it: extra -> distribution names."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    return {
        extra: {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in reqs}
        for extra, reqs in extras.items()
    }


def test_every_extra_a_sentence_names_installs_that_package():
    extras = setup_extras()
    for package in optional.PACKAGES.values():
        if package.extra:
            assert package.dist in extras[package.extra], (package, extras)
        else:
            # no user-facing extra installs it: only the test-only ones (`test`, and `smoke` for the
            # second-interpreter smoke in CI)
            assert package.hint and all(
                package.dist not in reqs for name, reqs in extras.items() if name not in ("test", "smoke")
            )


def test_the_sentences():
    assert optional.missing_message(["scipy.stats"], "compare") == (
        "compare needs scipy, which is not installed; install it with `pip install 'mcore-proxy[diagnose]'` "
        "(or `pip install scipy`)"
    )
    assert optional.missing_message(["transformers", "matplotlib"], "fidelity -o") == (
        "fidelity -o needs transformers and matplotlib, which are not installed; install them with "
        "`pip install 'mcore-proxy[hf,report]'` (or `pip install transformers matplotlib`)"
    )
    assert optional.missing_message(["matplotlib"], "compare -o", {"matplotlib": "diagnose"}).endswith(
        "`pip install 'mcore-proxy[diagnose]'` (or `pip install matplotlib`)"
    )
    text = optional.missing_message(["megatron.core"], "verify --functional")
    assert text == (
        "verify --functional needs megatron-core, which is not installed; install the megatron-core "
        "of your training stack (`pip install megatron-core`)"
    )
    assert "mcore-proxy[" not in text
    for message in (text, optional.missing_message(["scipy", "ruptures", "torch_npu"], "x")):
        assert "\n" not in message and message.count(". ") == 0


def test_require_returns_the_module_or_one_sentence(monkeypatch):
    assert require("json.decoder", why="x") is sys.modules["json.decoder"]
    absent(monkeypatch, "ruptures")
    with pytest.raises(MissingDependency) as info:
        require("ruptures", why="compare")
    assert isinstance(info.value, ProxyError)
    assert info.value.modules == ("ruptures",) and info.value.extras == ("diagnose",)
    assert str(info.value).startswith("compare needs ruptures, which is not installed")


def test_require_names_a_package_that_is_installed_but_broken(tmp_path, monkeypatch):
    (tmp_path / "ruptures_broken").mkdir()
    (tmp_path / "ruptures_broken" / "__init__.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        MissingDependency,
        match=r"x needs ruptures_broken, which is installed but does not import "
        r"\(No module named 'no_such_dependency_xyz'\)",
    ):
        require("ruptures_broken", why="x")


def test_check_imports_nothing_and_names_every_missing_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "ruptures", raising=False)
    check("ruptures", why="x")  # installed in the test environment
    assert "ruptures" not in sys.modules
    absent(monkeypatch, "scipy", "tensorboard")
    with pytest.raises(MissingDependency) as info:
        check("scipy", "ruptures", "tensorboard", why="campaign")
    assert info.value.modules == ("scipy", "tensorboard")
    assert str(info.value) == (
        "campaign needs scipy and tensorboard, which are not installed; install them with "
        "`pip install 'mcore-proxy[diagnose]'` (or `pip install scipy tensorboard`)"
    )


def test_an_import_error_is_a_missing_extra_only_for_a_known_absent_package(monkeypatch):
    absent(monkeypatch, "scipy")
    err = ModuleNotFoundError("No module named 'scipy'", name="scipy")
    assert "mcore-proxy[diagnose]" in str(from_import_error(err))
    assert from_import_error(ModuleNotFoundError("x", name="mcore_proxy.nothing")) is None  # our bug
    assert from_import_error(ModuleNotFoundError("x", name="numpy.nothing")) is None  # required
    assert from_import_error(ModuleNotFoundError("x", name="ruptures.nothing")) is None  # installed
    assert from_import_error(ImportError("cannot import name 'x' from 'scipy'", name="scipy")) is None


def fake_command(monkeypatch, func, command="compare"):
    args = argparse.Namespace(command=command, func=func, verbose=False, debug=False)
    monkeypatch.setattr(cli, "parse", lambda parser, argv: args)


def test_the_cli_turns_an_unchecked_missing_package_into_exit_2(monkeypatch, capsys):
    absent(monkeypatch, "scipy")

    def needs_scipy(args):
        from scipy import stats  # noqa: F401

    fake_command(monkeypatch, needs_scipy)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        (
            "mcore-proxy compare: error: this command needs scipy, which is not installed; "
            "install it with `pip install 'mcore-proxy[diagnose]'` (or `pip install scipy`)"
        )
    ]


def test_a_missing_module_of_our_own_stays_an_internal_error(monkeypatch, capsys):
    def broken(args):
        import mcore_proxy.no_such_module  # noqa: F401

    fake_command(monkeypatch, broken)
    assert cli.main([]) == 3
    assert "internal error: ModuleNotFoundError" in capsys.readouterr().err


def run_main(capsys, *argv) -> tuple[int, list[str]]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err.strip().splitlines()


def test_collect_and_fidelity_check_before_touching_their_output(monkeypatch, capsys, tmp_path):
    absent(monkeypatch, "transformers", "matplotlib")
    code, err = run_main(
        capsys, "collect", "--hf", tmp_path / "m", "--data", tmp_path / "d.jsonl", "-o", tmp_path / "stats"
    )
    assert code == 2 and len(err) == 1 and "collect --hf" in err[0] and "mcore-proxy[hf]" in err[0]
    code, err = run_main(
        capsys,
        "fidelity",
        "--orig",
        tmp_path / "a",
        "--proxy",
        tmp_path / "b",
        "--plan",
        tmp_path / "p.json",
        "--data",
        tmp_path / "d.jsonl",
        "-o",
        tmp_path / "report",
    )
    assert code == 2 and err == [
        (
            "mcore-proxy fidelity: error: fidelity -o needs transformers and matplotlib, "
            "which are not installed; install them with `pip install 'mcore-proxy[hf,report]'` "
            "(or `pip install transformers matplotlib`)"
        )
    ]
    assert sorted(tmp_path.iterdir()) == []


def test_campaign_checks_the_library_packages_before_any_run(monkeypatch, capsys, tmp_path):
    config = tmp_path / "campaign.json"
    config.write_text(
        json.dumps(
            {
                "format": "mcore-proxy-campaign-config/1",
                "work": "work",
                "command": ["{python}", "-c", "pass"],
                "log": "{run_dir}/events.out.tfevents.1",
                "faults": [{"name": "noise", "spec": "router_noise"}],
            }
        )
    )
    absent(monkeypatch, "ruptures", "tensorboard")
    code, err = run_main(capsys, "campaign", config)
    assert code == 2 and len(err) == 1
    assert "campaign (its signature library of the runs' metrics) needs ruptures and tensorboard" in err[0]
    assert "mcore-proxy[diagnose]" in err[0]
    assert not (tmp_path / "work").exists()
    assert cli.main(["campaign", str(config), "--dry-run"]) == 0  # a dry run needs neither


def test_verify_functional_checks_the_framework_before_the_bitwise_pass(monkeypatch, capsys, hf_proxy):
    orig, _, plan, _, proxy = hf_proxy("qwen3_moe")
    capsys.readouterr()
    absent(monkeypatch, "transformers")
    code, err = run_main(capsys, "verify", "--orig", orig, "--proxy", proxy, "--plan", plan, "--functional")
    assert code == 2 and err == [
        (
            "mcore-proxy verify: error: verify --functional (it runs both models in transformers) needs transformers, "
            "which is not installed; install it with `pip install 'mcore-proxy[hf]'` (or `pip install transformers`)"
        )
    ]
