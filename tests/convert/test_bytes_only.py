"""A legacy -> legacy convert moves bytes without importing torch (core/tensors.py), and writes
exactly the files the torch-tensor path writes for the same request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mcore_proxy.checkpoint.formats import write_checkpoint
from mcore_proxy.convert.pipeline import ConvertRequest, prepare

# a TP 2 GLU column split, GroupedMLP weights, MLA with an uneven pipeline
CASES = ["seq_tp2_pp2_ep2", "grouped_ep4", "deepseek_like_pp2_uneven"]

_CONVERT_WITHOUT_TORCH = """
import sys
from mcore_proxy.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", loaded[:3])
sys.exit(code or (3 if loaded else 0))
"""


@pytest.mark.parametrize("fixture", CASES)
def test_convert_imports_no_torch_and_writes_the_bytes_torch_writes(megatron_ckpt, proxy_plan, tmp_path, fixture):
    ckpt, _ = megatron_ckpt(fixture)
    plan, _ = proxy_plan(fixture)
    moved = tmp_path / "bytes"
    run = subprocess.run(
        [sys.executable, "-c", _CONVERT_WITHOUT_TORCH, "convert", str(ckpt), "--plan", str(plan), "-o", str(moved)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr

    prep = prepare(ConvertRequest(ckpt, tmp_path / "unused", plan=plan), check_space=False)
    computed = write_checkpoint(prep.view, tmp_path / "torch", prep.target, progress=False)
    files = sorted(p.relative_to(computed) for p in computed.rglob("*") if p.is_file())
    assert any(f.name == "model_optim_rng.pt" for f in files)
    for f in files:
        assert (moved / f).read_bytes() == (computed / f).read_bytes(), f
