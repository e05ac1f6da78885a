"""The wheel, installed as RL teams install tools into a framework's image: no checkout, no extras.

One session builds the wheel (tools/check_wheel.py: from a clean copy of the tree, contents
checked), creates a fresh virtual environment from the base interpreter, puts torch in it the way
tools/install.sh does (tools/install_plan.py: a local CPU wheel, never PyPI's CUDA build) and
installs the wheel, not editable, with no extra. Every process runs from a temporary folder with
no PYTHONPATH, so nothing of this checkout is importable there.

- Without extras, every command that needs one (compare, watch --baseline, campaign, collect,
  fidelity, verify --functional, select --report, stats show --png, ...) exits 2 with one line
  naming the extra, no traceback, nothing written. All of them run before anything else is
  installed into the environment (`bare_runs`).
- `mcore-proxy patches` prints the installed activation folder, byte for byte the checkout's
  patches/sitecustomize.py; on PYTHONPATH it is inert without MCORE_PROXY_* variables.
- Then the extras the launches need go in (transformers through the `hf` extra, megatron-core):
  a tiny transformers Qwen3-MoE (2 layers, 4 experts) trains 3 steps under
  `PYTHONPATH=$(mcore-proxy patches) MCORE_PROXY_FAULTS=router_noise...` and the fault report
  says the noise hit both MoE layers at all 3 steps; a 2-rank torchrun of a tiny megatron-core MoE
  GPT (examples/train_step_cpu.py, copied out) with tracing and faults writes per-rank routing
  statistics that the installed `mcore-proxy stats merge` sums, and per-rank fault reports.
  (Tracing by environment hooks megatron-core's router only; transformers models are traced by
  `collect`, so the transformers launch checks faults.)

Nothing here is skipped: a step that cannot run fails with its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
BASE = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
_spec = importlib.util.spec_from_file_location("check_wheel", REPO / "tools" / "check_wheel.py")
check_wheel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_wheel)

# what the bare install must not have (the extras' packages)
EXTRA_PACKAGES = (
    "transformers",
    "tokenizers",
    "accelerate",
    "matplotlib",
    "scipy",
    "ruptures",
    "tensorboard",
    "megatron-core",
)


def clean_env(**extra) -> dict:
    """A user's shell: no active environment, no PYTHONPATH, no mcore-proxy variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONHOME", "PYTHONPATH", "PYTHONSTARTUP")
        and not k.startswith("MCORE_PROXY_")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd: Path, timeout: float = 600, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@dataclass
class Venv:
    root: Path
    work: Path  # the current folder of every process: outside the checkout
    pin: Path  # constraints: the torch installed, so no later install replaces it

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.root / "bin" / "mcore-proxy"

    def pip(self, *args, timeout=900):
        # --no-compile: byte-compiling torch's and transformers' thousands of modules at install
        # takes longer than the install; Python compiles what a process imports anyway
        return run([self.python, "-m", "pip", "install", "-q", "--no-compile", *args], self.work, timeout=timeout)

    def installed(self) -> set[str]:
        out = run([self.python, "-m", "pip", "list", "--format=json"], self.work).stdout
        return {p["name"].lower() for p in json.loads(out)}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    try:
        path = check_wheel.build_wheel(out)
    except RuntimeError as err:
        pytest.fail(str(err))
    return path


@pytest.fixture(scope="session")
def bare(wheel, tmp_path_factory) -> Venv:
    """A fresh venv with torch and the wheel, no extras."""
    root = tmp_path_factory.mktemp("venv") / "env"
    work = tmp_path_factory.mktemp("work")
    if not BASE.is_file():
        pytest.fail(f"no base interpreter {BASE} to create the venv from")
    run([BASE, "-m", "venv", root], work)
    venv = Venv(root, work, work / "torch-pin.txt")
    # torch as tools/install.sh puts it: tools/install_plan.py decides, without network
    import torch

    version = torch.__version__.split("+")[0]
    facts = dict(
        line.split("=", 1)
        for line in run(
            [venv.python, REPO / "tools" / "install_plan.py", "--torch-version", version], work
        ).stdout.splitlines()
        if "=" in line
    )
    action, source = facts.get("torch_action"), facts.get("torch_source", "")
    if action == "wheel":
        venv.pip(source)
    elif action == "index":
        venv.pip(f"torch=={version}", "--index-url", source)
    elif action == "pypi":
        venv.pip(f"torch=={version}")
    elif action != "keep":
        pytest.fail(f"tools/install_plan.py gave no torch decision: {facts}")
    torch_now = run([venv.python, "-c", "import torch; print(torch.__version__)"], work).stdout.strip()
    venv.pin.write_text(f"torch=={torch_now}\n")
    venv.pip(wheel, "-c", venv.pin)
    return venv


# -- the commands that need an extra, run in the bare environment ---------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple  # "{X}" filled from the inputs
    extra: str  # the extra the sentence must name ("" for a training-stack package)
    names: str  # the package the sentence must name
    absent: tuple = ()  # outputs that must not exist afterwards


CASES = (
    Case(
        "compare",
        (
            "compare",
            "--orig-base",
            "{base}",
            "--orig-fault",
            "{run}",
            "--proxy-base",
            "{base}",
            "--proxy-fault",
            "{run}",
        ),
        "diagnose",
        "scipy",
    ),
    Case("watch-baseline", ("watch", "{run}", "--baseline", "{base}", "--once", "--no-view"), "diagnose", "scipy"),
    Case("campaign", ("campaign", "{campaign}"), "diagnose", "scipy", ("{out}/campaign/runs",)),
    Case(
        "collect",
        ("collect", "--hf", "{hf}", "--data", "{data}", "-o", "{out}/collect"),
        "hf",
        "transformers",
        ("{out}/collect",),
    ),
    Case(
        "fidelity-o",
        (
            "fidelity",
            "--orig",
            "{hf}",
            "--proxy",
            "{hf_proxy}",
            "--plan",
            "{plan}",
            "--data",
            "{data}",
            "-o",
            "{out}/fidelity",
        ),
        "hf,report",
        "transformers",
        ("{out}/fidelity",),
    ),
    Case(
        "verify-functional-hf",
        ("verify", "--orig", "{hf}", "--proxy", "{hf_proxy}", "--plan", "{plan}", "--functional"),
        "hf",
        "transformers",
    ),
    Case(
        "verify-functional-megatron",
        ("verify", "--orig", "{meg}", "--proxy", "{meg_proxy}", "--plan", "{plan}", "--functional"),
        "",
        "megatron-core",
    ),
    Case(
        "select-report",
        (
            "select",
            "--ckpt",
            "{hf}",
            "--stats",
            "{stats}",
            "-k",
            "8",
            "-o",
            "{out}/plan.json",
            "--report",
            "{out}/report",
        ),
        "report",
        "matplotlib",
        ("{out}/plan.json", "{out}/report"),
    ),
    Case("stats-show-png", ("stats", "show", "{stats}", "--png", "{out}/png"), "report", "matplotlib", ("{out}/png",)),
)


def jsonl(path: Path, shift: float) -> Path:
    rows = [
        {"step": i, "loss": 2.0 - 0.01 * i + (shift if i >= 20 else 0.0), "grad_norm": 1.0 + 0.01 * (i % 3)}
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def inputs(bare, hf_proxy) -> dict:
    """Inputs of the cases: the HF pipeline of the suite (built by the test environment), logs, a
    campaign file, and Megatron legacy copies of the original and the proxy."""
    from mcore_proxy.cli import main
    from mcore_proxy.testing.hf_fixtures import calibration_jsonl

    orig, stats, plan_path, _, proxy = hf_proxy("qwen3_moe")
    d = bare.work / "inputs"
    d.mkdir()
    campaign = d / "campaign.json"
    campaign.write_text(
        json.dumps(
            {
                "format": "mcore-proxy-campaign-config/1",
                "work": str(bare.work / "out" / "campaign"),
                "command": [
                    "{python}",
                    "-c",
                    "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])",
                    str(d / "base.jsonl"),
                    "{run_dir}/metrics.jsonl",
                ],
                "log": "{run_dir}/metrics.jsonl",
                "faults": [{"name": "noise", "spec": "router_noise:std=0.5"}],
            }
        )
    )
    values = {
        "hf": orig,
        "hf_proxy": proxy,
        "plan": plan_path,
        "stats": stats,
        "data": calibration_jsonl(d / "data.jsonl", records=8),
        "base": jsonl(d / "base.jsonl", 0.0),
        "run": jsonl(d / "run.jsonl", 0.5),
        "campaign": campaign,
        "out": bare.work / "out",
        "meg": d / "meg",
        "meg_proxy": d / "meg_proxy",
    }
    (bare.work / "out").mkdir()
    # HF -> Megatron legacy, then pruned by the plan (here: in-process is fast)
    assert main(["convert", str(orig), "-o", str(values["meg"]), "--format", "legacy"]) == 0
    assert main(["convert", str(values["meg"]), "--plan", str(plan_path), "-o", str(values["meg_proxy"])]) == 0
    return {k: str(v) for k, v in values.items()}


@pytest.fixture(scope="session")
def bare_runs(bare, inputs) -> dict[str, subprocess.CompletedProcess]:
    """Every case's command in the bare environment, two at a time, before any extra is installed."""
    assert not set(EXTRA_PACKAGES) & bare.installed(), "the bare environment already has an extra's package"

    def one(case):
        return case.name, run([bare.cli, *(a.format(**inputs) for a in case.argv)], bare.work, timeout=300, check=False)

    with ThreadPoolExecutor(2) as pool:
        done = dict(pool.map(one, CASES))
    return done


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_missing_extra_is_one_sentence_and_exit_2(case, bare_runs, inputs):
    proc = bare_runs[case.name]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"mcore-proxy {case.argv[0]}")
    assert case.names in lines[0]
    if case.extra:
        assert f"mcore-proxy[{case.extra}]" in lines[0], lines[0]
    else:
        assert "mcore-proxy[" not in lines[0] and f"pip install {case.names}" in lines[0], lines[0]
    for path in case.absent:
        assert not Path(path.format(**inputs)).exists(), f"{case.name} wrote {path.format(**inputs)}"


def test_the_bare_install_converts_and_verifies(bare, inputs):
    """What needs no extra works: verify (bit for bit) of the proxy the bare install wrote."""
    proc = run(
        [
            bare.cli,
            "verify",
            "--orig",
            inputs["meg"],
            "--proxy",
            inputs["meg_proxy"],
            "--plan",
            inputs["plan"],
            "--json",
        ],
        bare.work,
    )
    assert json.loads(proc.stdout)["ok"] is True


@pytest.fixture(scope="session")
def patches_out(bare) -> str:
    """What `mcore-proxy patches` prints in the environment."""
    return run([bare.cli, "patches"], bare.work).stdout


def test_patches_prints_the_installed_activation(bare, patches_out):
    folder = Path(patches_out.strip())
    assert patches_out.count("\n") == 1 and folder.is_absolute()
    site = Path(
        run([bare.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], bare.work).stdout.strip()
    )
    assert folder == site / "mcore_proxy" / "activation" / "_patches"
    assert sorted(p.name for p in folder.iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]
    assert (folder / "sitecustomize.py").read_bytes() == (REPO / "patches" / "sitecustomize.py").read_bytes()
    doc = json.loads(run([bare.cli, "patches", "--json"], bare.work).stdout)
    assert doc == {
        "format": "mcore-proxy-patches/1",
        "path": str(folder),
        "variables": ["MCORE_PROXY_TRACE_DIR", "MCORE_PROXY_FAULTS"],
    }
    # a campaign puts the same folder on its runs' PYTHONPATH
    code = "from mcore_proxy.campaign.runner import patches_dir; print(patches_dir())"
    assert run([bare.python, "-c", code], bare.work).stdout.strip() == str(folder)


def test_the_installed_activation_is_inert_and_checks_its_variable(bare, patches_out):
    folder = patches_out.strip()
    probe = "import sys; print(sorted(m for m in sys.modules if m.startswith('mcore_proxy')))"
    assert run([bare.python, "-c", probe], bare.work, PYTHONPATH=folder).stdout.strip() == "[]"
    bad = run(
        [bare.python, "-c", "print('ran')"],
        bare.work,
        check=False,
        PYTHONPATH=folder,
        MCORE_PROXY_FAULTS="no_such_fault",
    )
    assert bad.returncode == 2 and "ran" not in bad.stdout
    assert bad.stderr.strip().startswith("mcore-proxy: MCORE_PROXY_FAULTS='no_such_fault': ")
    assert len(bad.stderr.strip().splitlines()) == 1


# -- launches, after the extras they need -----------------------------------------------------------


@pytest.fixture(scope="session")
def launch_env(bare, bare_runs, patches_out, wheel) -> Venv:
    """The same environment plus transformers (the `hf` extra of the wheel) and megatron-core, the
    version of the test environment's (both from the package registry)."""
    bare.pip(f"{wheel}[hf]", f"megatron-core=={metadata.version('megatron-core')}", "-c", bare.pin)
    return bare


def hf_train(venv: Venv, **env) -> dict:
    script = venv.work / "hf_moe_train.py"
    if not script.exists():
        shutil.copy(SCRIPTS / "hf_moe_train.py", script)
    out = run([venv.python, script], venv.work, **env).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_faults_in_a_transformers_training_launch(launch_env, patches_out):
    venv, folder = launch_env, patches_out.strip()
    report = venv.work / "faults.json"
    inert = hf_train(venv, PYTHONPATH=folder)
    faulted = hf_train(
        venv, PYTHONPATH=folder, MCORE_PROXY_FAULTS="router_noise:std=0.5", MCORE_PROXY_FAULTS_REPORT=report
    )
    assert inert["mcore_proxy"] == []  # the activation imports nothing while no variable is set
    assert "mcore_proxy.faults.runtime" in faulted["mcore_proxy"]
    assert faulted["losses"] != inert["losses"]
    doc = json.loads(report.read_text())
    # 2 MoE layers x 3 forward passes, the noise on at optimizer steps 0, 1, 2
    assert doc == {
        "faults": "router_noise:std=0.5",
        "report": [{"fault": "router_noise:std=0.5", "calls": 6, "active_calls": 6, "active_steps": [0, 1, 2]}],
    }


@pytest.mark.megatron
def test_trace_and_faults_in_a_megatron_torchrun_launch(launch_env, patches_out):
    venv, folder = launch_env, patches_out.strip()
    d = venv.work / "megatron"
    d.mkdir()
    script = shutil.copy(REPO / "examples" / "train_step_cpu.py", d / "train_step_cpu.py")
    assert "mcore_proxy.trace" not in Path(script).read_text() and "mcore_proxy.faults" not in Path(script).read_text()
    np.save(d / "tokens.npy", np.random.default_rng(0).integers(0, 256, 2000).astype(np.int32))
    steps, micro_batch, seq = 3, 2, 32
    run(
        [
            venv.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            script,
            "--tokens",
            d / "tokens.npy",
            "--ep",
            "2",
            "--steps",
            steps,
            "--micro-batch",
            micro_batch,
            "--seq-length",
            seq,
        ],
        d,
        PYTHONPATH=folder,
        MCORE_PROXY_TRACE_DIR=d / "trace",
        MCORE_PROXY_FAULTS="router_noise:std=0.5;update_omission:every=2",
        MCORE_PROXY_FAULTS_REPORT=d / "faults.json",
    )
    assert sorted(p.name for p in (d / "trace").iterdir()) == [
        "rank00000.json",
        "rank00000.safetensors",
        "rank00001.json",
        "rank00001.safetensors",
    ]
    merged = json.loads(run([venv.cli, "stats", "merge", d / "trace", "--json"], d).stdout)
    # 4 MoE layers; each of the 2 data-parallel ranks routes its own 3 x 2 x 32 tokens per layer
    assert merged["ranks_merged"] == 2 and merged["moe_layers"] == 4
    assert merged["total_tokens"] == 4 * 2 * steps * micro_batch * seq
    for rank in (0, 1):
        doc = json.loads((d / f"faults.json.rank{rank}").read_text())
        noise, omission = doc["report"]
        # 4 layers x 3 forward passes; every optimizer step counted, steps 0 and 2 left out
        assert noise == {"fault": "router_noise:std=0.5", "calls": 12, "active_calls": 12, "active_steps": [0, 1, 2]}
        assert omission["fault"].startswith("update_omission") and omission["active_steps"] == [0, 2]
