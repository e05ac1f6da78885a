"""`mcore-proxy estimate`: table and JSON carry the same numbers; checkpoints give metadata only."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import zipfile

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.estimate.model import count_parameters
from mcore_proxy.estimate.sources import from_preset, merge


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_and_json_carry_the_same_numbers(capsys):
    code, text, _ = run(capsys, "--preset", "qwen3-30b-a3b", "-k", "48")
    assert code == 0
    code, raw, _ = run(capsys, "--preset", "qwen3-30b-a3b", "-k", "48", "--json")
    d = json.loads(raw)
    assert code == 0 and d["format"] == "mcore-proxy-estimate/1"
    o, p = d["original"], d["proxy"]
    assert f"devices: {o['devices']} -> {p['devices']} ({d['ratios']['devices']:.2f}x fewer)" in text
    assert re.search(
        rf"^parameters\s+{o['parameters']['total'] / 1e9:.2f} B\s+{p['parameters']['total'] / 1e9:.2f} B$", text, re.M
    )
    for key, label in (("weights", "weights"), ("optimizer", "optimizer state"), ("total", "total")):
        row = (
            rf"^{label} / device\s+{o['memory_bytes'][key] / 2**30:.2f} GiB\s+{p['memory_bytes'][key] / 2**30:.2f} GiB$"
        )
        assert re.search(row, text, re.M), label
    lay = o["layout"]
    assert f"TP={lay['tp']} PP={lay['pp']} EP={lay['ep']} ETP={lay['etp']} DP={lay['dp']}" in text
    assert lay["devices"] == lay["tp"] * lay["pp"] * lay["dp"] == o["devices"]
    assert p["num_experts"] == 48 and p["layout"]["ep"] <= 48 and 48 % p["layout"]["ep"] == 0
    assert d["ratios"]["expert_flops_per_token"] == 1.0


GDN = "GQA + linear (Gated DeltaNet)"


@pytest.mark.parametrize(
    "preset, k, attention",
    [
        ("deepseek-v4-flash", 64, "V4 (CSA/HCA)"),
        ("deepseek-v4-pro", 96, "V4 (CSA/HCA)"),
        ("qwen3.5-397b-a17b", 128, GDN),
        ("qwen3.5-35b-a3b", 64, GDN),
        ("glm-4.5", 40, "GQA"),
        ("kimi-k2", 96, "MLA"),
        ("gpt-oss-120b", 32, "GQA"),
    ],
)
def test_every_new_preset_plans_its_proxy(capsys, preset, k, attention):
    """`mcore-proxy estimate --preset NAME` for each new preset: the original's parameters are the
    preset's, the proxy keeps K experts and fits on no more devices than the original."""
    code, raw, err = run(capsys, "--preset", preset, "-k", str(k), "--json")
    assert code == 0, err
    d = json.loads(raw)
    o, p = d["original"], d["proxy"]
    assert o["parameters"]["total"] == count_parameters(merge(from_preset(preset))).total
    assert p["num_experts"] == k and p["parameters"]["experts"] * 4 == o["parameters"]["experts"]
    assert 0 < p["devices"] <= o["devices"] and d["model"]["attention"] == attention
    assert max(o["memory_bytes"]["total"], p["memory_bytes"]["total"]) <= d["budget_bytes"]


def _scramble_tensor_bytes(path) -> int:
    """Overwrite every tensor storage member of a torch zip file in place (its structure stays)."""
    scrambled = 0
    with zipfile.ZipFile(path) as zf:
        members = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size]
    with open(path, "r+b") as f:
        for info in members:
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            f.write(b"\x7f" * info.compress_size)
            scrambled += info.compress_size
    return scrambled


def test_a_checkpoint_contributes_metadata_only(megatron_ckpt, tmp_path, capsys):
    """Scrambled tensor bytes change nothing: estimate reads args, names and shapes, never data."""
    ckpt, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    scrambled = sum(_scramble_tensor_bytes(f) for f in copy.rglob("model_optim_rng.pt"))
    view, name = open_checkpoint(copy), "decoder.layers.1.mlp.router.weight"
    assert not torch.equal(view.get(name), open_checkpoint(ckpt).get(name))  # the data really is gone
    code, pristine, _ = run(capsys, "--ckpt", str(ckpt), "-k", "8", "--device-memory", "1GiB", "--json")
    assert code == 0
    code, damaged, _ = run(capsys, "--ckpt", str(copy), "-k", "8", "--device-memory", "1GiB", "--json")
    assert code == 0 and scrambled > 100_000
    pristine, damaged = json.loads(pristine), json.loads(damaged)
    for d in (pristine, damaged):
        assert d["model"].pop("source").endswith("ckpt args") and d["model"]["name"] == "ckpt"
    assert damaged == pristine
    sizes = sum(math.prod(view.shape(n)) for n in view.names())
    assert pristine["original"]["parameters"]["total"] == sizes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "qwen3-30b-a3b", "-k", "48", "--ep", "32"], "--num-experts 48 is not divisible by --ep 32"),
        (
            ["--preset", "qwen3-30b-a3b", "-k", "48", "--device-memory", "4GiB"],
            "no layout of at most 16384 devices fits Qwen3-30B-A3B with 128 experts in 3.6 GiB",
        ),
        (["--preset", "deepseek-v3", "-k", "12"], "is not divisible by the 8 routing groups"),
        (["-k", "8"], "estimate needs a model: --ckpt CKPT, --hf-config config.json or --preset NAME"),
    ],
)
def test_infeasible_requests_exit_2_with_one_sentence_and_the_nearest_choice(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and message in line
    assert "nearest feasible" in line or "needs a model" in line
