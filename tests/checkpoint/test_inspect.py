"""inspect reports each fixture's layout field by field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.inspect import describe
from mcore_proxy.cli import main

EXPECTED = {
    "seq_tp2_pp2_ep2": dict(
        parallel=dict(tp=2, pp=2, ep=2, etp=2, vpp=1, stage_layers=[2, 2], pipeline_layout=None),
        expert_layout="sequential",
        dense_layers=[],
        moe_layers=[0, 1, 2, 3],
        num_experts=8,
        topk=2,
        score_function="softmax",
        num_groups=None,
        expert_bias=False,
        shared_expert_size=None,
        dtype="float32",
        files=8,
    ),
    "grouped_ep4": dict(
        parallel=dict(tp=1, pp=1, ep=4, etp=1, vpp=1, stage_layers=[4], pipeline_layout=None),
        expert_layout="grouped",
        dense_layers=[],
        moe_layers=[0, 1, 2, 3],
        num_experts=8,
        topk=2,
        expert_bias=False,
        files=4,
    ),
    "seq_tp2_etp1_ep2": dict(
        parallel=dict(tp=2, pp=1, ep=2, etp=1, vpp=1, stage_layers=[4], pipeline_layout=None),
        expert_layout="sequential",
        files=2,
    ),
    "deepseek_like_pp2_uneven": dict(
        parallel=dict(tp=1, pp=2, ep=2, etp=1, vpp=1, stage_layers=[1, 3], pipeline_layout=None),
        dense_layers=[0],
        moe_layers=[1, 2, 3],
        num_experts=16,
        topk=4,
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        expert_bias=True,
        shared_expert_size=24,
        files=4,
        attention="gqa",
        layer_spec="local",
    ),
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_inspect_reports_layout(megatron_ckpt, fixture):
    ckpt, _ = megatron_ckpt(fixture)
    info = describe(open_checkpoint(ckpt))
    assert info["checkpoint_format"] == "legacy" and info["iteration"] == 10 and info["num_layers"] == 4
    for field, value in EXPECTED[fixture].items():
        assert info[field] == value, field
    # routed experts: E x L_moe x (fc1 [2F, H] + fc2 [H, F]) x 4 bytes
    experts = info["num_experts"] * len(info["moe_layers"]) * (2 * 16 * 32 + 32 * 16) * 4
    assert info["expert_bytes"] == experts
    assert info["total_bytes"] > experts


def test_inspect_cli_json(megatron_ckpt, capsys):
    ckpt, _ = megatron_ckpt("grouped_ep4")
    assert main(["inspect", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_layout"] == "grouped" and info["parallel"]["ep"] == 4
    assert main(["inspect", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "TP=1 PP=1 EP=4" in text and "layout grouped" in text


def test_inspect_says_what_an_hf_family_holds_and_what_works(hf_model, tmp_path, capsys):
    """DeepSeek-V4's release: expert F from config.json, the hash-routed layer, the quantization,
    its Megatron mapping (Megatron-LM dev's names) and the MTP note; Qwen3-MoE: its Megatron mapping."""
    from mcore_proxy.testing.quantized import v4_release_copy

    release = v4_release_copy(hf_model("deepseek_v4"), tmp_path / "v4")
    info = describe(open_checkpoint(release))
    assert info["family"] == "DeepSeek-V4" and info["moe_ffn_hidden_size"] == 32 and info["hash_layers"] == ["0"]
    assert info["quantization"] == ["e8m0-scale"] and info["mtp_layers"] == [0]
    assert info["support"]["megatron"] == "HF <-> Megatron as DeepSeek-V4" and "MTP" in info["support"]["notes"]
    capsys.readouterr()
    assert main(["inspect", str(release)]) == 0
    out = capsys.readouterr().out
    assert "hash-routed layers 0" in out and "FP8/FP4 with E8M0 scales" in out and "support" in out
    assert describe(open_checkpoint(hf_model("qwen3_moe")))["support"]["megatron"] == "HF <-> Megatron as Qwen3-MoE"


# torch cannot be imported in this child: inspect of a legacy checkpoint must not need it (its
# import costs more than indexing hundreds of rank files: bench/RESULTS.md, issue 23)
_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
from mcore_proxy.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules or sys.modules["torch"] is None
sys.exit(code)
"""


@pytest.mark.parametrize("fixture", ["deepseek_like_pp2_uneven", "grouped_ep4"])
def test_inspect_of_a_legacy_checkpoint_imports_no_torch(megatron_ckpt, fixture, capsys):
    ckpt, _ = megatron_ckpt(fixture)
    assert main(["inspect", str(ckpt), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    child = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, "inspect", str(ckpt), "--json"], capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == expected


def test_files_and_bytes_counts_as_rglob_does(tmp_path):
    """One stat per file, same answer as rglob + is_file + stat: nested folders, a symlinked file
    counted, a symlinked folder not entered, a dangling link not a file."""
    from mcore_proxy.checkpoint.inspect import files_and_bytes

    (tmp_path / "iter_1" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_1" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x" * 1000)
    (tmp_path / "iter_1" / "args.txt").write_bytes(b"y" * 7)
    (tmp_path / "link.pt").symlink_to(tmp_path / "iter_1" / "args.txt")
    (tmp_path / "linked_dir").symlink_to(tmp_path / "iter_1", target_is_directory=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files_and_bytes(tmp_path) == (len(files), sum(p.stat().st_size for p in files)) == (3, 1014)
    assert files_and_bytes(tmp_path / "link.pt") == (1, 7)
