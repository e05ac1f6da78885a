"""tools/install.sh: which interpreter and which torch the README's two commands set up.

The torch decision (tools/install_plan.py) is tested without network on wheel folders built
here; the shell logic in dry runs on a fresh machine; and one real run of both README commands'
set-up creates a fresh project venv with no environment active. That run makes torch importable
for python3 through PYTHONPATH (as an Ascend or CUDA stack makes it importable), so it checks the
"reuse a working torch" path without installing a 200 MB wheel; the install paths are the dry runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("install_plan", REPO / "tools" / "install_plan.py")
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)

# this interpreter's wheel tags, asked in a child process: importing pip here would break a
# later `import setuptools` in this process (its _distutils_hack finds distutils already set up)
TAGS = json.loads(
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from pip._vendor.packaging.tags import "
            "sys_tags; print(json.dumps([str(t) for t in sys_tags()]))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
)
TAG = TAGS[0]  # the most specific one
BASE = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"


def fake_wheel(folder: Path, name: str, requires: tuple[str, ...] = ()) -> Path:
    """A torch wheel file with a METADATA member (all install_plan reads of a wheel)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    meta = "Metadata-Version: 2.1\nName: torch\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("torch-2.13.0.dist-info/METADATA", meta)
    return path


def test_pip_config_find_links_and_indexes_are_read():
    text = (
        "global.find-links='/opt/wheels'\n:env:.find-links='/a /b'\n"
        "global.extra-index-url='file:///opt/pypi/simple https://mirror/simple'\n"
        "global.index-url='https://pypi.org/simple'\nglobal.timeout='60'\n"
    )
    links, indexes = plan.parse_pip_config(text)
    assert links == ["/opt/wheels", "/a", "/b"]
    assert indexes == ["file:///opt/pypi/simple", "https://mirror/simple", "https://pypi.org/simple"]


def test_only_local_folders_are_searched(tmp_path):
    index = tmp_path / "simple"
    (index / "torch").mkdir(parents=True)
    links = [str(tmp_path), "https://example.org/wheels", str(tmp_path / "missing")]
    assert plan.local_dir(f"file://{index}") == index
    assert plan.local_dir("https://download.pytorch.org/whl/cpu") is None
    assert plan.wheel_folders(links, [f"file://{index}", "https://pypi.org/simple"]) == [tmp_path, index / "torch"]


def test_a_local_wheel_counts_only_if_it_is_a_cpu_build_for_this_interpreter(tmp_path):
    tags = set(TAGS)
    cpu = fake_wheel(tmp_path, f"torch-2.13.0+cpu-{TAG}.whl")
    cuda_label = fake_wheel(tmp_path, f"torch-2.13.0+cu121-{TAG}.whl")
    cuda_deps = fake_wheel(
        tmp_path, f"torch-2.13.0-{TAG}.whl", ("nvidia-cublas-cu12==12.4 ; platform_system == 'Linux'",)
    )
    other_version = fake_wheel(tmp_path, f"torch-2.12.0+cpu-{TAG}.whl")
    other_python = fake_wheel(tmp_path, "torch-2.13.0+cpu-cp27-cp27mu-manylinux1_x86_64.whl")
    assert plan.is_cpu_wheel(cpu, "2.13.0", tags)
    assert not plan.is_cpu_wheel(cuda_label, "2.13.0", tags)
    assert not plan.is_cpu_wheel(cuda_deps, "2.13.0", tags)
    assert not plan.is_cpu_wheel(other_version, "2.13.0", tags)
    assert not plan.is_cpu_wheel(other_python, "2.13.0", tags)
    no_cuda_deps = fake_wheel(tmp_path / "mac", f"torch-2.13.0-{TAG}.whl", ("filelock", "sympy>=1.13"))
    assert plan.is_cpu_wheel(no_cuda_deps, "2.13.0", tags)  # e.g. macOS wheels: no label
    assert plan.find_local_cpu_wheel([tmp_path], "2.13.0", tags) == cpu


def test_torch_source_decision():
    wheel = Path("/w/torch-2.13.0+cpu.whl")
    assert plan.choose_torch(True, "linux", wheel, None) == ("keep", "")
    assert plan.choose_torch(False, "linux", wheel, None) == ("wheel", str(wheel))
    assert plan.choose_torch(False, "linux", None, None) == ("index", "https://download.pytorch.org/whl/cpu")
    assert plan.choose_torch(False, "linux", None, "https://mirror/whl/cpu") == ("index", "https://mirror/whl/cpu")
    assert plan.choose_torch(False, "linux", None, "pip") == ("pypi", "")
    assert plan.choose_torch(False, "darwin", None, None) == ("pypi", "")
    assert plan.choose_torch(False, "win32", None, None) == ("pypi", "")


def machine(tmp_path: Path, python3: Path = BASE, **extra: str) -> dict:
    """The environment of a fresh shell: no active environment, `python3` on PATH is `python3`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").unlink(missing_ok=True)
    (bin_dir / "python3").symlink_to(python3)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "PYTHONHOME", "PYTHONPATH")
    }
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", MCORE_PROXY_VENV=str(tmp_path / "venv"), **extra)
    return env


def run(cmd: list[str], env: dict, cwd: Path = REPO, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def plain_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def base_imports_torch() -> bool:
    return run([str(BASE), "-c", "import torch"], plain_env()).returncode == 0


@pytest.mark.parametrize("local_wheel", [True, False], ids=["local-cpu-wheel", "no-local-wheel"])
def test_dry_run_on_a_fresh_machine(tmp_path, local_wheel):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = fake_wheel(wheels, f"torch-2.13.0+cpu-{TAG}.whl") if local_wheel else None
    # pip reads no configuration file, only this find-links folder (PIP_CONFIG_FILE=os.devnull)
    env = machine(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(wheels))
    r = run(["bash", "tools/install.sh", "--dry-run"], env)
    assert r.returncode == 0, r.stderr
    venv = tmp_path / "venv"
    assert r.stdout.strip() == f"{venv}/bin/python"
    assert not venv.exists()  # a dry run changes nothing
    assert f"no environment active: would create the project venv {venv}" in r.stderr
    if base_imports_torch():
        assert "--system-site-packages" in r.stderr and "left alone" in r.stderr
    elif local_wheel:
        assert "(isolated;" in r.stderr
        assert f"would install the local CPU wheel {wheel}" in r.stderr
    elif sys.platform.startswith("linux"):
        assert "would install torch==2.13.0 from PyTorch's CPU index https://download.pytorch.org/whl/cpu" in r.stderr
        assert "--index-url https://download.pytorch.org/whl/cpu" in r.stderr
        mirror = run(["bash", "tools/install.sh", "--dry-run"], {**env, "MCORE_PROXY_TORCH_INDEX": "https://m/whl/cpu"})
        assert "--index-url https://m/whl/cpu" in mirror.stderr


def test_an_active_virtual_environment_is_used_as_it_is(tmp_path):
    env = machine(tmp_path, VIRTUAL_ENV=sys.prefix)
    r = run(["bash", "tools/install.sh", "--dry-run"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{sys.prefix}/bin/python"
    assert f"(the active virtual environment {sys.prefix})" in r.stderr
    assert "already imports" in r.stderr and "left alone" in r.stderr
    assert "would create" not in r.stderr and not (tmp_path / "venv").exists()


def test_an_externally_managed_python_is_refused_with_the_fix(tmp_path):
    system = Path("/usr/bin/python3")
    managed = (
        system.is_file()
        and run(
            [
                str(system),
                "-c",
                "import sysconfig, pathlib, sys; sys.exit(0 if "
                "(pathlib.Path(sysconfig.get_path('stdlib')) / 'EXTERNALLY-MANAGED')"
                ".is_file() else 1)",
            ],
            plain_env(),
        ).returncode
        == 0
    )
    if not managed:
        pytest.skip("no externally-managed (PEP 668) system Python on this machine")
    env = machine(tmp_path, PYTHON=str(system))
    env.pop("PIP_BREAK_SYSTEM_PACKAGES", None)
    r = run(["bash", "tools/install.sh", "--dry-run"], env)
    assert r.returncode == 2
    assert "externally-managed system Python (PEP 668)" in r.stderr and "unset PYTHON" in r.stderr
    assert r.stdout == ""


def test_both_readme_commands_set_up_and_use_a_fresh_project_venv(tmp_path):
    """No environment active, torch importable by python3 (PYTHONPATH: a stand-in for a system
    torch stack): the first command creates the venv with --system-site-packages, leaves torch
    alone, installs mcore-proxy into the venv, and runs pytest with the venv's interpreter; the
    second command reuses the venv."""
    stack = sysconfig.get_paths()["purelib"]  # where this test's torch lives
    import torch

    env = machine(tmp_path, PYTHONPATH=stack)
    venv = tmp_path / "venv"
    tests = run(["bash", "tests/run.sh", "--co", "-vv", "tests/tools/test_install.py::test_torch_source_decision"], env)
    assert tests.returncode == 0, tests.stderr[-3000:]
    assert f"no environment active: creating the project venv {venv} (seeing" in tests.stderr
    assert f"-- {venv}/bin/python" in tests.stdout  # pytest ran in the new venv
    assert "1 test collected" in tests.stdout or "collected 1 item" in tests.stdout
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not (site / "torch").exists()  # the stack's torch was reused
    assert list(site.glob("mcore_proxy-*.dist-info")) and (venv / "bin" / "mcore-proxy").exists()

    quick = run(["bash", "examples/quickstart.sh", "--setup-only"], env)
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert f"python: {venv}/bin/python (the project venv {venv} (no environment active))" in quick.stderr
    assert f"== environment: python {venv}/bin/python, torch {torch.__version__} ({torch.__file__})" in quick.stdout
