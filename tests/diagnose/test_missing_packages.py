"""Without an optional package (the `diagnose` extra: scipy, ruptures, tensorboard, matplotlib; or a
reader's wandb / swanlab) compare, watch and triage say in one sentence what to install and exit 2,
never an internal error (exit 3) or a traceback. Each command runs in a subprocess whose imports of
the packages in MCORE_PROXY_TEST_BLOCK fail exactly as a missing package's do (a `sitecustomize.py`
on PYTHONPATH puts a finder raising ModuleNotFoundError first on sys.meta_path)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mcore_proxy.diagnose.compare import ROLES

SITECUSTOMIZE = textwrap.dedent("""
    import os, sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in os.environ.get("MCORE_PROXY_TEST_BLOCK", "").split(","):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
""")
EXTRA = "pip install 'mcore-proxy[diagnose]'"


@pytest.fixture
def run_without(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def run(blocked, *argv):
        env = {
            **os.environ,
            "MCORE_PROXY_TEST_BLOCK": ",".join(blocked),
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        }
        return subprocess.run(
            [sys.executable, "-m", "mcore_proxy.cli", *argv], capture_output=True, text=True, env=env, timeout=120
        )

    return run


def one_sentence(done, *words):
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_the_blocker_blocks(run_without, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import scipy"],
        capture_output=True,
        text=True,
        env={**os.environ, "MCORE_PROXY_TEST_BLOCK": "scipy", "PYTHONPATH": str(tmp_path / "site")},
    )
    assert done.returncode != 0 and "ModuleNotFoundError: No module named 'scipy'" in done.stderr


def verl_logs(tmp_path, synthetic):
    runs = {
        "orig_base": synthetic.curves(seed=0),
        "orig_fault": synthetic.curves("omission", seed=0, onset=30),
        "proxy_base": synthetic.curves(seed=5),
        "proxy_fault": synthetic.curves("omission", seed=5, onset=30),
    }
    return {role: synthetic.write_verl_console(tmp_path / f"{role}.log", data) for role, data in runs.items()}


def compare_args(paths):
    return [a for role in ROLES for a in (f"--{role.replace('_', '-')}", paths[role])]


def test_watch_without_scipy(run_without, tmp_path, synthetic):
    """The issue's case: `watch LOG` without scipy, as a user runs it."""
    paths = verl_logs(tmp_path, synthetic)
    one_sentence(run_without(["scipy"], "watch", paths["orig_fault"], "--once", "--no-view"), "watch", "scipy", EXTRA)


# The other cases in one process (the CLI's start imports torch: seconds each): `main(argv)` per case,
# with the packages of MCORE_PROXY_TEST_BLOCK (read at every import) set per case. A package is blocked before
# anything imports it (the order of CASES), since an imported module no longer goes through finders.
DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from mcore_proxy.cli import main

    results = []
    for blocked, argv in json.loads(sys.argv[1]):
        os.environ["MCORE_PROXY_TEST_BLOCK"] = ",".join(blocked)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        results.append([code, err.getvalue()])
    print(json.dumps(results))
""")


def test_every_command_and_reader_without_its_package(tmp_path, synthetic):
    paths = verl_logs(tmp_path, synthetic)
    library = tmp_path / "library.json"
    library.write_text(
        json.dumps({"format": "mcore-proxy-library/1", "baseline": {"name": "base", "log": "b"}, "entries": []})
    )
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"")
    for name in ("run-abc.wandb", "run-abc.swanlab"):
        (tmp_path / name).write_bytes(b"\x00" * 64)
    cases = [  # (blocked, argv, words of the sentence)
        (
            ["scipy"],
            ["compare", "--run", paths["orig_fault"], "--baseline", paths["orig_base"], "--library", str(library)],
            ["scipy", EXTRA],
        ),  # triage
        (["scipy"], ["compare", *compare_args(paths)], ["scipy", EXTRA]),
        (["ruptures"], ["compare", *compare_args(paths)], ["ruptures", EXTRA]),
        (["ruptures"], ["watch", paths["orig_fault"], "--once", "--no-view"], ["watch", "ruptures", EXTRA]),
        (["matplotlib"], ["compare", *compare_args(paths), "-o", str(tmp_path / "report")], ["matplotlib", EXTRA]),
        (["tensorboard"], ["watch", str(tmp_path / "tb"), "--once", "--no-view"], ["tensorboard", EXTRA]),
        (["wandb"], ["watch", str(tmp_path / "run-abc.wandb"), "--once", "--no-view"], ["wandb", "pip install wandb"]),
        (
            ["swanlab"],
            ["watch", str(tmp_path / "run-abc.swanlab"), "--once", "--no-view"],
            ["swanlab", "pip install swanlab"],
        ),
    ]
    site = tmp_path / "dyn"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps([[b, a] for b, a, _ in cases])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for (blocked, argv, words), (code, err) in zip(cases, results):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (blocked, argv[0], code, err)
        assert all(w in lines[0] for w in words), (blocked, lines[0])
    assert not (tmp_path / "report").exists()
